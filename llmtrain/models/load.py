"""Hugging Face models and tokenizers: from a local directory / hub id, or random init from a config.

Nothing here knows about backends: a model comes back as a plain nn.Module in fp32 (master weights)
on the CPU; the backend moves, wraps and casts it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from llmtrain.config import ConfigError
from llmtrain.models import fused_head
from llmtrain.models.attention import (
    PACKABLE_SDPA,
    SEGMENT_ATTENTION,
    register_packable_sdpa,
    register_segment_attention,
)
from llmtrain.models.flex import FLEX_ATTENTION, FLEX_IMPLEMENTATIONS, register_flex_attention
from llmtrain.models.init import Gather, missing_modules, seeded_init

if TYPE_CHECKING:
    from llmtrain.models.lora import LoraSettings

log = logging.getLogger(__name__)

# The dropout knobs each family exposes; the first ones present on a config are set.
DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                  "hidden_dropout_prob", "attention_probs_dropout_prob")


def load_tokenizer(source: str, trust_remote_code: bool):
    """Tokenizer from a directory or hub id; one without a pad token gets eos as pad (the usual way)."""
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token  # labels are built before padding: eos stays a target
        else:
            tokenizer.add_special_tokens({"pad_token": "<pad>"})  # grows the vocabulary: embeddings resize
    return tokenizer


def use_distinct_pad_token(tokenizer) -> None:
    """Give a tokenizer whose pad is its eos another pad token: the unk token when it has one (no new
    embedding row), else a new `<|pad|>`. A sequence classifier exported with pad == eos would be pooled
    by transformers at the token before the EOS (it looks for the last non-pad token)."""
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id != tokenizer.eos_token_id:
        return
    if tokenizer.unk_token is not None and tokenizer.unk_token_id != tokenizer.eos_token_id:
        tokenizer.pad_token = tokenizer.unk_token
    else:
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})  # grows the vocabulary: embeddings resize
    log.info("pad token: %s (id %d), not the eos: the exported model pools at the EOS in transformers too",
             tokenizer.pad_token, tokenizer.pad_token_id)


def model_config(name_or_path: str | None, from_config: dict | None, config_path: str | None,
                 trust_remote_code: bool, vocab_size: int | None = None,
                 pad_token_id: int | None = None) -> PretrainedConfig:
    """The architecture config alone (no weights): what validation, dry runs and the planner read.
    `pad_token_id`: the tokenizer's, for a config drawn up from sizes whose family default lies outside the
    vocabulary (check_pad_token_id)."""
    if from_config is not None:
        # plain containers all the way down: a nested field (Llama-3's rope_parameters) as an OmegaConf node fails
        # transformers' config type checks
        fields = {key: OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig))
                  else value for key, value in from_config.items()}
        model_type = fields.pop("model_type")
        check_from_config_fields(model_type, fields)
        if vocab_size is not None:
            fields.setdefault("vocab_size", vocab_size)
        config = AutoConfig.for_model(model_type, **fields)
        check_pad_token_id(config, None if "pad_token_id" in fields else pad_token_id,
                           "model.from_config.pad_token_id" if "pad_token_id" in fields else None)
        return config
    source = config_path if config_path is not None and not Path(name_or_path).is_dir() else name_or_path
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    check_pad_token_id(config, None, f"{source}: its config.json")
    return config


def check_pad_token_id(config: PretrainedConfig, tokenizer_pad: int | None, given_in: str | None) -> None:
    """A pad_token_id must index the embedding (nn.Embedding's padding_idx), checked before any model is built.
    One the user gave (`given_in`: from_config or a checkpoint's config.json) outside the vocabulary is an error that
    names the field and the fix. A family default (Phi-3's 32000 in a config drawn up from sizes) becomes the
    tokenizer's pad id when it is inside the vocabulary, else None, and the log says so when the model is built."""
    pad, vocab = getattr(config, "pad_token_id", None), getattr(config, "vocab_size", None)
    if pad is None or not isinstance(vocab, int) or 0 <= pad < vocab:
        return
    if given_in is not None:
        raise ConfigError(f"{given_in}: pad_token_id={pad} lies outside vocab_size={vocab} (nn.Embedding's "
                          "padding_idx must index the embedding): set it to the tokenizer's pad id or null")
    new = tokenizer_pad if tokenizer_pad is not None and 0 <= tokenizer_pad < vocab else None
    if tokenizer_pad is not None:  # building the model (not the planner's meta copy): say it once per role
        log.info("%s config: its default pad_token_id=%s lies outside vocab_size=%d: set to %s (the tokenizer's "
                 "pad id)", config.model_type, pad, vocab, new)
    config.pad_token_id = new


def _tiny_model_types() -> set[str]:
    """The model types with a shipped `model=tiny_<type>` group."""
    from llmtrain.paths import conf_dir

    return {p.stem.removeprefix("tiny_") for p in (conf_dir() / "model").glob("tiny_*.yaml")}


def check_from_config_fields(model_type: str, fields: dict) -> None:
    """`model.from_config` is model_type plus fields of that transformers config class (its own names, or the
    aliases in its attribute_map, e.g. GPT-2's hidden_size for n_embd). Fields of another class, as when only
    model_type is overridden on top of tiny_llama, and one field given under two names are errors that say
    what to do instead."""
    try:
        config_class = type(AutoConfig.for_model(model_type))
    except ValueError:
        raise ConfigError(f"model.from_config.model_type={model_type!r} is not a transformers model type "
                          "(llama, qwen2, mistral, gpt2, ...)") from None
    own, aliases = set(config_class().to_dict()), dict(getattr(config_class, "attribute_map", {}))
    unknown = sorted(set(fields) - own - set(aliases))
    twice = [f"{alias} is {config_class.__name__}'s alias of {field} and both are set: set only {field}"
             for alias, field in aliases.items() if alias in fields and field in fields]
    tiny = _tiny_model_types() if unknown or twice else set()
    other = {name for t in tiny - {model_type} for name in AutoConfig.for_model(t).to_dict()}
    carried, misspelled = [f for f in unknown if f in other], [f for f in unknown if f not in other]
    fix = (f"use model=tiny_{model_type} and override its fields, or " if model_type in tiny else "") + \
        f"replace the whole dict: model.from_config=null model.from_config.model_type={model_type} " \
        "model.from_config.FIELD=VALUE ..."
    problems = []
    if carried:
        problems.append(f"{model_type} configs ({config_class.__name__}) have no field(s) {', '.join(carried)}: "
                        "fields of another model class, carried over from the model group when only "
                        f"model.from_config.model_type changes; {fix}")
    if misspelled:
        problems.append(f"{model_type} configs ({config_class.__name__}) have no field(s) {', '.join(misspelled)}; "
                        f"check the spelling against transformers' {config_class.__name__}")
    problems += twice
    if problems:
        raise ConfigError("model.from_config: " + "\n  - model.from_config: ".join(problems))


def resolve_attn_implementation(requested: str, device: torch.device, precision: str = "bf16",
                                dropout: float = 0.0) -> str:
    """auto: flash-attention 2 (varlen for packed rows) on a GPU that has it installed and a 16-bit compute
    dtype (its kernels reject fp32); else on a GPU FlexAttention with a document mask (one compiled kernel
    per layer); on the CPU sdpa per sample.

    The GPU choice of flex_segments over sdpa_segments is not measured here (no GPU on the machine it was
    written on; `benchmarks/attention.py --device cuda` measures it). It rests on FlexAttention's published GPU
    speed under torch.compile (PyTorch's FlexAttention post, Aug 2024: 90 % of FlashAttention-2 forward and
    85 % backward on A100; torchtune's sample-packing throughput +71 % with its document mask), against
    sdpa_segments' one sdpa launch per segment per layer from Python (~20 small kernels a layer for 4 rows of
    512 at the benchmark's median sample of 100 tokens, forward and again backward). FlexAttention needs
    Triton (shipped with CUDA torch) and has no dropout. On the CPU it loses (benchmarks/README.md): eager it
    materialises the (B, H, T, T) scores; compiled it has no backward (torch 2.13).
    """
    if requested != "auto":
        if requested in FLEX_IMPLEMENTATIONS and device.type == "cpu":
            raise ConfigError(f"model.attn_implementation={requested}: FlexAttention has no backward on the CPU "
                              f"(torch {torch.__version__}); use sdpa_segments (or auto) on the CPU")
        return requested
    if device.type != "cuda":
        return SEGMENT_ATTENTION
    if precision in ("bf16", "fp16") and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    if dropout == 0 and importlib.util.find_spec("triton") is not None:
        return FLEX_ATTENTION
    return SEGMENT_ATTENTION


# what transformers' model class must declare for each attention llmtrain can run it with: transformers checks a
# name containing "sdpa" (ours too) against _supports_sdpa, and so on; a registered function of another name
# (flex_segments) runs in every class whose attention goes through ALL_ATTENTION_FUNCTIONS
_SUPPORT_FLAG = {SEGMENT_ATTENTION: "_supports_sdpa", "sdpa": "_supports_sdpa", PACKABLE_SDPA: "_supports_sdpa",
                 FLEX_ATTENTION: "_supports_attention_backend", "flex_attention": "_supports_flex_attn",
                 "flash_attention_2": "_supports_flash_attn", "flash_attention_3": "_supports_flash_attn"}


def causal_lm_class(config: PretrainedConfig):
    """The transformers causal-LM class of a config, from the auto mapping (a class: no weights, no instance);
    None for remote code or a config without a causal LM."""
    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None


def unsupported_attention(attn: str, config: PretrainedConfig) -> tuple[type, str, list[str]] | None:
    """(class, flag, what it supports) when the config's transformers class lacks `attn`; None when it runs it (or
    llmtrain cannot tell: remote code, an attention with no flag)."""
    cls, flag = causal_lm_class(config), _SUPPORT_FLAG.get(attn)
    if cls is None or flag is None or getattr(cls, flag, True):
        return None
    return cls, flag, ["eager"] + sorted({name for name, f in _SUPPORT_FLAG.items() if getattr(cls, f, False)})


def unsupported_attentions(config: PretrainedConfig) -> frozenset[str]:
    """Every attention llmtrain runs that the config's transformers class lacks (Gemma-2: sdpa, sdpa_segments)."""
    return frozenset(name for name in _SUPPORT_FLAG if unsupported_attention(name, config) is not None)


def _unsupported_message(requested: str, config: PretrainedConfig, cls: type, supported: list[str]) -> str:
    return (f"model.attn_implementation={requested}: {cls.__name__} ({config.model_type}) does not support it in "
            f"transformers; use one of: auto, {', '.join(supported)}")


WINDOW_KEEPING = ("sdpa_segments", "flash_attention_2", "flash_attention_3")  # packed rows with sliding windows kept


def sliding_window(config: PretrainedConfig) -> int | None:
    """The attention window of a family whose layers (some or all) slide (Mistral, Gemma-2/3); None when none do."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def packed_window_problems(attn: str, configs: list[PretrainedConfig], max_seq_len: int) -> list[str]:
    """Packed rows reach eager/sdpa as one dense block-causal mask and flex as a document BlockMask, for every layer
    alike: a sliding layer would see its whole sample. Refused where a sample can be longer than the window."""
    if attn in WINDOW_KEEPING:
        return []
    return [f"model.attn_implementation={attn} with packed rows: {config.model_type}'s sliding window of "
            f"{sliding_window(config)} tokens would be lost (one block-causal mask for every layer), and "
            f"data.max_seq_len={max_seq_len} is longer; use model.attn_implementation=sdpa_segments (it keeps the "
            "window), flash_attention_2 on a GPU, or data.packing=false"
            for config in configs if sliding_window(config) is not None and max_seq_len > sliding_window(config)]


def family_attention_problems(requested: str, configs: list[PretrainedConfig]) -> list[str]:
    """An explicit `model.attn_implementation` that a role's transformers class does not run, one line per family,
    each naming the field and the fix (validation: from the architecture config alone, before any weights)."""
    if requested == "auto":
        return []
    problems = []
    for config in configs:
        lacking = unsupported_attention(requested, config)
        if lacking is not None:
            line = _unsupported_message(requested, config, lacking[0], lacking[2])
            problems += [line] if line not in problems else []
    return problems


def local_model_config(source) -> PretrainedConfig | None:
    """A role's architecture config when it is at hand without the hub and without weights (`source`: a ModelSource):
    model.from_config, a local checkpoint's config.json, or model.config_path (model_config, as the planner reads
    it). None for a hub id without config_path, or a config the planner reports as invalid itself."""
    local = source.from_config is not None or source.config_path is not None or \
        (source.name_or_path is not None and Path(source.name_or_path).is_dir())
    if not local:
        return None
    try:
        return model_config(source.name_or_path, source.from_config, source.config_path, source.trust_remote_code)
    except (ConfigError, OSError, ValueError):
        return None


def attention_for_family(attn: str, requested: str, configs: list[PretrainedConfig]) -> str:
    """The run's attention, checked against what each role's model class supports, before any weights load.

    transformers declares per class what it runs (`_supports_sdpa`, `_supports_flex_attn`, `_supports_flash_attn`);
    Gemma-2 has no sdpa (sdpa cannot apply its attention-logit softcapping). With `auto`, a family that lacks the
    chosen attention runs eager attention (packed rows then get the dense block mask: data/collate.py); an explicit
    choice it lacks is an error that says what it supports. Validation refuses that explicit choice first
    (family_attention_problems, from config.json or model.from_config); this stays as the backstop for what
    validation cannot read (a hub id without model.config_path) and for a stage's own attention (PPO's rollouts)."""
    for config in configs:
        lacking = unsupported_attention(attn, config)
        if lacking is None:
            continue
        cls, flag, supported = lacking
        if requested != "auto":
            raise ConfigError(_unsupported_message(requested, config, cls, supported))
        log.info("attention: %s has no %s in transformers (%s): eager attention%s", cls.__name__, attn, flag,
                 "; packed rows get a dense (B, 1, T, T) block mask" if attn == SEGMENT_ATTENTION else "")
        attn = "eager"
    return attn


def set_dropout(config: PretrainedConfig, dropout: float) -> None:
    for name in DROPOUT_FIELDS:
        if hasattr(config, name):
            setattr(config, name, dropout)


HEADS = ("lm", "scalar")  # next-token logits; one score per token (reward model / critic), pooled by the stage


def auto_class(head: str):
    """The transformers auto class for a head: a causal LM, or the family's sequence classifier with one label
    (a linear `score` layer on the last hidden states)."""
    from transformers import AutoModelForSequenceClassification

    if head not in HEADS:
        raise ConfigError(f"model head {head!r} is not one of {', '.join(HEADS)}")
    return AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification


def build_model(*, name_or_path: str | None, from_config: dict | None, config_path: str | None,
                tokenizer: Any, attn_implementation: str, dropout: float,
                activation_checkpointing: bool, trust_remote_code: bool, head: str = "lm", seed: int = 0,
                gather: Gather | None = None, lora: LoraSettings | None = None,
                fused_head_chunk: int | None = None, fused_head_kernel: str = "chunked") -> torch.nn.Module:
    """An fp32 model on the CPU (a causal LM, or with `head="scalar"` a one-label sequence classifier), its
    embeddings sized to the tokenizer.

    Random weights (from_config, or a head the checkpoint lacks) come from `seeded_init`: the same for a
    seed on every backend and world size. Under a `torch.device("meta")` context (FSDP2 on ranks other
    than 0) the same modules are built without storage and nothing is read: from_pretrained refuses meta,
    so the architecture comes from the checkpoint's config; the backend fills the weights in later.
    `lora`: peft's adapters on top (base frozen), added here so that they too are built inside the backend's
    model_init_context (models/lora.py). `fused_head_chunk`: a causal LM's head computes the loss over chunks of
    this many tokens (0: the default) while a stage asks it to (models/fused_head.py), the summed loss with
    `fused_head_kernel` ("chunked" or "liger": models/liger.py)."""
    config = model_config(name_or_path, from_config, config_path, trust_remote_code, vocab_size=len(tokenizer),
                          pad_token_id=tokenizer.pad_token_id)
    set_dropout(config, dropout)
    config.use_cache = False
    if head == "scalar":
        config.num_labels = 1
    if attn_implementation == SEGMENT_ATTENTION:
        register_segment_attention()
    if attn_implementation == PACKABLE_SDPA:
        register_packable_sdpa()
    if attn_implementation == FLEX_ATTENTION:
        register_flex_attention()
    on_meta = torch.get_default_device().type == "meta"
    cls = auto_class(head)
    gather = gather or (lambda params: contextlib.nullcontext())
    if from_config is not None:
        # a config drawn up from sizes carries its family's default token ids (Llama: bos 1, eos 2), not the
        # tokenizer's: an export would then stop generating at the wrong token
        for name in ("bos_token_id", "eos_token_id"):
            if getattr(tokenizer, name, None) is not None:
                setattr(config, name, getattr(tokenizer, name))
    if from_config is not None or on_meta:
        try:
            model = cls.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32,
                                    trust_remote_code=trust_remote_code)
        except Exception as error:
            if not on_meta:
                raise
            raise ConfigError(f"{name_or_path or config.model_type}: the model cannot be built on the meta device "
                              f"({type(error).__name__}: {error}); use backend=ddp or backend=deepspeed") from error
        if not on_meta:
            seeded_init(model, seed, gather=gather)
    else:
        quantized = lora is not None and lora.load_in_4bit  # QLoRA (CUDA only: models/lora_checks.qlora_problems)
        if quantized:
            from llmtrain.models.lora import quantized_load_kwargs
        model, info = cls.from_pretrained(
            name_or_path, config=config, attn_implementation=attn_implementation, dtype=torch.float32,
            trust_remote_code=trust_remote_code, output_loading_info=True,
            **(quantized_load_kwargs() if quantized else {}))
        new = missing_modules(info["missing_keys"])
        if new:
            log.info("%s: %s not in the checkpoint, initialised from the seed", name_or_path, ", ".join(sorted(new)))
            seeded_init(model, seed, modules=new, gather=gather)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        # The mean-and-covariance init of the new rows reads values, which meta tensors have none of.
        model.resize_token_embeddings(len(tokenizer), mean_resizing=not on_meta)
    if tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if head == "lm" and fused_head_chunk is not None and not fused_head.install(model, fused_head_chunk,
                                                                                fused_head_kernel):
        raise ConfigError(f"model.fused_loss: {type(model.get_output_embeddings()).__name__} is not a plain Linear "
                          "LM head, which the fused head-and-loss path needs; set model.fused_loss=off")
    if activation_checkpointing:
        # Non-reentrant: it needs no input that requires grad, so a LoRA model (frozen embeddings) gets its adapter
        # gradients without `enable_input_require_grads()`, which the reentrant variant would need.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None and lora.load_in_4bit:
        from llmtrain.models.lora import prepare_quantized

        model = prepare_quantized(model, activation_checkpointing)
    if lora is not None:
        from llmtrain.models.lora import apply_lora

        model = apply_lora(model, lora, head=head, seed=seed, gather=gather)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
