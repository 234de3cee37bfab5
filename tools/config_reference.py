"""Writes docs/reference/config.md, the configuration reference, from the config dataclasses themselves.

    python tools/config_reference.py           # regenerate docs/reference/config.md
    python tools/config_reference.py --check   # exit 1 when the committed file differs or a field has no description

Every field of every node (the run's own schema in llmtrain/config.py, each stage's node from the stage registry,
each backend's typed group from llmtrain.backends.BACKENDS) with its type, its schema default, the values it takes
(from the tables the checks use: config.CHOICES, validation.registry_choices and the registries below) and its
description: the comment written beside the field in its dataclass (`name: int = 1  # what it means`, continued on
the comment lines below it), or the comment lines just above a field that has none beside it. A field with neither
is an error (tests/unit/test_docs.py), so a new field cannot land without one line of meaning.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "docs" / "reference" / "config.md"

# Allowed values of fields whose checks live in a registry or a module table: field -> "module:ATTRIBUTE" (the
# names of a dict or the items of a tuple). The schema's own table (config.CHOICES) and validation's registry choices
# are read as they are; a name that disappears from a module fails the generator, which is the point.
REGISTRIES = {
    "optim.name": "llmtrain.optim.spec:OPTIMIZERS",
    "optim.muon.adjust_lr_fn": "llmtrain.optim.spec:ADJUST_LR",
    "optim.muon.experts": "llmtrain.optim.spec:EXPERTS",
    "dpo.loss": "llmtrain.losses.dpo:DPO_LOSSES",
    "kto.loss_type": "llmtrain.losses.kto:KTO_LOSSES",
    "ppo.advantage": "llmtrain.losses.advantages:ADVANTAGE_ESTIMATORS",
    "ppo.scale_rewards": "llmtrain.losses.advantages:SCALE_REWARDS",
    "ppo.kl.estimator": "llmtrain.losses.kl:KL_ESTIMATORS",
    "ppo.loss_agg": "llmtrain.losses.ppo:LOSS_AGGREGATIONS",
    "ppo.ratio": "llmtrain.losses.ppo:RATIO_LEVELS",
    "ppo.critic.init": "llmtrain.stages.ppo.checks:CRITIC_INITS",
    "ppo.old_logprobs": "llmtrain.stages.ppo.checks:OLD_LOGPROBS",
    "ppo.rollout.engine": "llmtrain.stages.ppo.engines:ROLLOUT_ENGINES",
    "ppo.importance_sampling.mode": "llmtrain.losses.importance:IMPORTANCE_SAMPLING_MODES",
    "backend.pp_schedule": "llmtrain.backends.pipeline_checks:SCHEDULES",
    "backend.offload_optimizer.device": "llmtrain.backends.deepspeed_config:OFFLOAD_DEVICES",
    "backend.offload_param.device": "llmtrain.backends.deepspeed_config:OFFLOAD_DEVICES",
}
EXTRA_VALUES = {"ppo.importance_sampling.mode": ("auto", "none")}  # accepted beside the registry's names

RUN_SECTIONS = ("trainer", "optim", "model", "data", "logger", "peft", "plan")

# Descriptions of fields whose dataclass has no comment beside them yet, in files this page does not own. Each one
# belongs beside its field: move it there (a `# ...` comment) and delete it here. An entry whose field has its own
# comment now, or no longer exists, fails the check (`stale_pending`), so this table only shrinks.
PENDING = {
    "backend.zero_stage": "the ZeRO stage, 0 to 3 (the presets zero0..zero3 set it)",
    "backend.offload_optimizer.nvme_path": "the NVMe folder when device=nvme",
    "backend.offload_optimizer.pin_memory": "pinned host memory for the offloaded tensors (DeepSpeed's pin_memory)",
    "backend.offload_param.nvme_path": "the NVMe folder when device=nvme",
    "backend.offload_param.pin_memory": "pinned host memory for the offloaded tensors (DeepSpeed's pin_memory)",
    "backend.overlap_comm": "DeepSpeed's overlap_comm: overlap the gradient reduction with the backward",
    "backend.contiguous_gradients": "DeepSpeed's contiguous_gradients: gradients copied into one buffer as they "
                                    "are produced",
    "backend.stage3_prefetch_bucket_size": "ZeRO-3: parameters fetched ahead, in elements; auto: 0.9·h²",
    "backend.stage3_param_persistence_threshold": "ZeRO-3 keeps parameters up to this size whole on every rank; "
                                                  "auto: 10·h",
    "backend.stage3_max_live_parameters": "DeepSpeed's stage3_max_live_parameters: parameters ZeRO-3 keeps "
                                          "gathered at once",
    "backend.dp_replicate": "replicas of the sharded model (HSDP: dp_replicate × dp_shard)",
    "backend.dp_shard": "ranks each replica's weights, gradients and optimizer state are sharded over; -1: inferred "
                        "from the world size",
    "backend.tp": "tensor-parallel degree (the family's transformers TP plan; fsdp2_tp)",
    "backend.reshard_after_forward": "free a block's gathered weights after its forward and gather again in "
                                     "backward; false keeps them (zb and zbv need false)",
    "backend.cpu_offload": "FSDP2's CPUOffloadPolicy: shards, gradients and optimizer state in host memory (a GPU "
                           "run; on a CPU it does nothing)",
    "backend.compile": "torch.compile each decoder block before FSDP wraps it",
    "dpo.beta": "β: the strength of the pull towards the reference (implied reward β·log π/π_ref)",
    "kto.beta": "β: the implied reward β·(log π − log π_ref) inside KTO's sigmoid",
    "ppo.reward.model": "a reward-model directory (stage=reward's hf/ export): a frozen role scoring each response "
                        "at its EOS",
    "ppo.rollout.vllm.urls": "vLLM servers you run; rank r sends its prompts to urls[r % len(urls)]",
    "ppo.rollout.max_new_tokens": "the longest response; generation stops earlier at a stop token",
    "ppo.rollout.temperature": "sampling temperature: samples come from softmax(logits / T), what the loss scores",
    "ppo.rollout.top_p": "nucleus sampling; 1.0: off",
    "ppo.filter_max_rounds": "filter_groups: the most batches of prompts one iteration draws",
    "ppo.epochs": "passes over each iteration's rollout, in mini-batches of mini_batch_size",
    "ppo.entropy_coef": "the weight of the entropy term in the actor's loss",
    "ppo.gamma": "discount γ of the token rewards (gae, reinforce_pp)",
    "ppo.lam": "GAE's λ",
    "ppo.whiten_advantages": "advantages normalised over the valid tokens of the whole global batch (the REINFORCE++ "
                             "estimators need it; stage=grpo presets false)",
}


# ---- descriptions: the comments beside (or above) each field in its dataclass's source ---------------------------

def field_comments(cls: type) -> dict[str, str]:
    """{field: its comment} for the fields `cls` itself declares (not inherited ones)."""
    source = textwrap.dedent(inspect.getsource(cls))
    own = set(cls.__dict__.get("__annotations__", {}))
    lines: list[tuple[str, str, str]] = []  # (kind, field or "", comment text) per physical line of the body
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    by_line: dict[int, list[tokenize.TokenInfo]] = {}
    for tok in tokens:
        by_line.setdefault(tok.start[0], []).append(tok)
    body_indent = None
    for number in sorted(by_line):
        toks = [t for t in by_line[number] if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                                                               tokenize.DEDENT)]
        if not toks:
            continue
        first = toks[0]
        comment = next((t.string.lstrip("#").strip() for t in toks if t.type == tokenize.COMMENT), "")
        if first.type == tokenize.COMMENT:
            lines.append(("comment", "", comment))
            continue
        if first.type == tokenize.NAME and len(toks) > 1 and toks[1].string == ":" and first.string in own:
            if body_indent is None:
                body_indent = first.start[1]
            if first.start[1] == body_indent:
                lines.append(("field", first.string, comment))
                continue
        lines.append(("other", "", comment))
    found: dict[str, list[str]] = {}
    pending: list[str] = []  # comment lines not yet given to a field
    last: str | None = None  # the field above them, when it has its own comment beside it
    for kind, name, text in lines:
        if kind == "comment":
            pending.append(text)
        elif kind == "field":
            if pending and last is not None and text:  # both fields have their own: the lines continue the upper
                found[last] += pending
                pending = []
            found[name] = [*pending, text] if text else pending
            pending = []
            last = name if text else None
        else:
            if pending and last is not None:
                found[last] += pending
            pending, last = [], None
    if pending and last is not None:
        found[last] += pending
    return {name: " ".join(part for part in parts if part).strip() for name, parts in found.items()}


def comments_of(cls: type) -> dict[str, str]:
    """Comments of every field of `cls`, inherited ones included (the nearest class that declares it)."""
    merged: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and klass.__module__.startswith("llmtrain"):
            merged.update({k: v for k, v in field_comments(klass).items() if v or k not in merged})
    return merged


# ---- the rows ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    name: str  # dotted, as on the command line
    type: str
    default: str
    values: str
    description: str
    owner: str  # module:Class that declares it
    commented: bool = False  # the description is the comment beside the field (not PENDING's)


def type_name(hint: typing.Any) -> str:
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (" \\| ".join(type_name(a) for a in args)) + " \\| null"
    if origin in (list, typing.List):
        return f"list[{type_name(typing.get_args(hint)[0])}]"
    if origin in (dict, typing.Dict):
        return "mapping"
    if hint is typing.Any:
        return "any"
    return getattr(hint, "__name__", str(hint))


def show(value: typing.Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return repr(value)


def default_of(f: dataclasses.Field) -> typing.Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def registry_values(name: str) -> tuple[str, ...] | None:
    from llmtrain.config import CHOICES
    from llmtrain.validation import registry_choices

    if name in CHOICES:
        return tuple(CHOICES[name])
    if name in registry_choices():
        return tuple(registry_choices()[name])
    if name in REGISTRIES:
        module, attribute = REGISTRIES[name].split(":")
        table = getattr(importlib.import_module(module), attribute)
        return (*EXTRA_VALUES.get(name, ()), *table)
    return None


def docstring(cls: type) -> str:
    """The class's own docstring on one line ("" for the signature dataclasses write when there is none)."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(doc.split())


def rows_of(cls: type, prefix: str) -> list[Row]:
    """Every leaf field under `cls` (nested dataclasses flattened), in declaration order."""
    hints = typing.get_type_hints(cls)
    comments = comments_of(cls)
    rows = []
    for f in dataclasses.fields(cls):
        hint, name = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(hint):
            rows += rows_of(hint, name + ".")
            continue
        values = registry_values(name)
        if values is None and hint is bool:
            values = ("true", "false")
        owner = next(k for k in cls.__mro__ if f.name in k.__dict__.get("__annotations__", {}))
        rows.append(Row(name, type_name(hint), show(default_of(f)), ", ".join(f"`{v}`" for v in values or ()),
                        comments.get(f.name, "") or PENDING.get(name, ""), f"{owner.__module__}:{owner.__qualname__}",
                        bool(comments.get(f.name))))
    return rows


def sections() -> list[tuple[str, str, list[Row]]]:
    """(title, intro, rows) in page order."""
    from llmtrain.backends import BACKENDS
    from llmtrain.config import RunConfig
    from llmtrain.stages.registry import config_nodes, stage_specs

    hints = typing.get_type_hints(RunConfig)
    top = [f for f in dataclasses.fields(RunConfig) if not dataclasses.is_dataclass(hints[f.name])]
    top_rows = [r for r in rows_of(RunConfig, "") if "." not in r.name and r.name in {f.name for f in top}]
    out = [("Run", "The top-level fields (`llmtrain/config.py`, `RunConfig`).", top_rows)]
    for node in RUN_SECTIONS:
        cls = hints[node]
        intro = f"`{node}.*` (`llmtrain/config.py`, `{cls.__name__}`)."
        if docstring(cls):
            intro += " " + docstring(cls)
        out.append((node, intro, rows_of(cls, node + ".")))
    out.append(("stage", "`stage=NAME` picks the stage (`conf/stage/NAME.yaml`); its own fields are in the node "
                "named below.", rows_of(hints["stage"], "stage.")))
    for name, spec in BACKENDS.items():
        cls = spec.config_class
        presets = ", ".join(f"`backend={p}`" for p in spec.presets)
        doc = docstring(cls)
        out.append((f"backend: {name}", f"Chosen with {presets} (`{cls.__module__}`, `{cls.__name__}`). {doc}".strip(),
                    rows_of(cls, "backend.")))
    stages_of: dict[str, list[str]] = {}
    for spec in stage_specs().values():
        if spec.config_node:
            stages_of.setdefault(spec.config_node, []).append(spec.name)
    for node, cls in config_nodes().items():
        names = ", ".join(f"`stage={s}`" for s in stages_of[node])
        doc = docstring(cls)
        out.append((node, f"`{node}.*`, read by {names} (`{cls.__module__}`, `{cls.__name__}`). {doc}".strip(),
                    rows_of(cls, node + ".")))
    return out


def group_options() -> list[str]:
    """The config groups (`GROUP=OPTION`) and the recipes, each with the first comment line of its yaml."""
    from llmtrain.paths import available_recipes, conf_dir, recipes_dir

    def first_comment(path: Path) -> str:
        for line in path.read_text().splitlines():
            if line.startswith("#") and not line.startswith("# @package"):
                return line.lstrip("# ").strip()
        return ""

    lines = ["## Groups and recipes", "",
             "A group option is a yaml file in `conf/GROUP/`; `GROUP=OPTION` on the command line picks it (the command "
             "line wins over the recipe). A recipe (`recipes/NAME.yaml`, `recipe=NAME`) is a complete run.", "",
             "| group | option | what it is |", "|---|---|---|"]
    root = conf_dir()
    for group in sorted(p for p in root.iterdir() if p.is_dir()):
        for option in sorted(group.glob("*.yaml")):
            lines.append(f"| `{group.name}` | `{option.stem}` | {escape(first_comment(option))} |")
    lines += ["", "| recipe | what it is |", "|---|---|"]
    lines += [f"| `{name}` | {escape(first_comment(recipes_dir() / f'{name}.yaml'))} |" for name in available_recipes()]
    return lines


def escape(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def stale_pending(all_sections: list[tuple[str, str, list[Row]]]) -> list[str]:
    """PENDING entries whose field is gone or now has its own comment (to delete from PENDING)."""
    rows = {r.name: r for _, _, section in all_sections for r in section}
    return sorted(name for name in PENDING if name not in rows or rows[name].commented)


def render() -> tuple[str, list[str]]:
    """(the page, the problems: fields without a description, stale PENDING entries)."""
    lines = ["# Configuration reference", "",
             "<!-- generated by `python tools/config_reference.py` from the config dataclasses; do not edit by hand:",
             "     tests/unit/test_docs.py fails when this file is not what the code generates -->", "",
             "Every field of every config node, as `FIELD=VALUE` on the command line or in a recipe. The default is "
             "the schema's; `conf/config.yaml`, the group options and the recipes set many fields (see "
             "[Recipes and the command line](../guide/cli.md)). Values: what the checks accept (an unknown value "
             "stops the run before any model loads, naming the field). Generated from the code, so it cannot drift: "
             "the description of a field is the comment beside it in its dataclass.", ""]
    missing = []
    all_sections = sections()
    lines += ["Sections: " + " · ".join(f"[{title}](#{anchor(title)})" for title, _, _ in all_sections), ""]
    for title, intro, rows in all_sections:
        lines += [f"## {title}", "", intro, "", "| field | type | default | values | description |",
                  "|---|---|---|---|---|"]
        for r in rows:
            if not r.description:
                missing.append(f"{r.name} ({r.owner})")
            lines.append(f"| `{r.name}` | {r.type} | `{escape(r.default)}` | {r.values} | {escape(r.description)} |")
        lines.append("")
    lines += group_options()
    missing += [f"PENDING[{name!r}]: the field is gone or has its own comment now; delete the entry"
                for name in stale_pending(all_sections)]
    return "\n".join(lines) + "\n", missing


def anchor(title: str) -> str:
    """The id MkDocs (Python-Markdown's toc) gives a heading."""
    import re
    import unicodedata

    text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def main(argv: list[str]) -> int:
    page, missing = render()
    if missing:
        print("fields without a description (write a comment beside the field in its dataclass):\n  "
              + "\n  ".join(missing), file=sys.stderr)
    if "--check" in argv:
        current = OUTPUT.read_text() if OUTPUT.is_file() else ""
        if current != page:
            print(f"{OUTPUT.relative_to(REPO)} is out of date: run python tools/config_reference.py", file=sys.stderr)
            return 1
        return 1 if missing else 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(page)
    print(f"wrote {OUTPUT.relative_to(REPO)}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main(sys.argv[1:]))
