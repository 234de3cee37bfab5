"""The tokens a reply ends with, derived once per run: the tokenizer's eos, the checkpoint's
`generation_config.json` eos list, and, for chat data, the chat template's end of turn.

A base tokenizer's eos is often not what a chat template ends a turn with (Llama 3: `<|end_of_text|>` vs
`<|eot_id|>`; Qwen: `<|endoftext|>` vs `<|im_end|>`; the bundled tokenizer: `</s>` vs `<|end|>`). SFT on
messages teaches the template's token, so generation, masks and scores must stop there too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MARKER = "llmtrain-reply-marker"  # the assistant content rendered to find what the template prints after it


@dataclass(frozen=True)
class StopTokens:
    ids: tuple[int, ...]  # every token that ends a reply, the tokenizer's eos first
    names: tuple[str, ...]  # where each came from: "eos", "generation_config", "end of turn"
    end_of_turn: int | None  # the chat template's end-of-turn token (None: no chat data or no such token)

    def describe(self, tokenizer) -> str:
        return ", ".join(f"{tokenizer.convert_ids_to_tokens(i)} ({i}, {name})" for i, name in zip(self.ids, self.names))


def special_token_ids(tokenizer) -> set[int]:
    added = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return set(tokenizer.all_special_ids) | added


def end_of_turn_id(tokenizer) -> int | None:
    """The first special token the chat template prints after an assistant reply's content (`<|eot_id|>`,
    `<|im_end|>`, `<end_of_turn>`, `<|end|>`); a newline after it is formatting. None without a template or
    when the template prints no special token there."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": MARKER}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    if MARKER not in text:
        return None
    after = tokenizer(text[text.index(MARKER) + len(MARKER):], add_special_tokens=False)["input_ids"]
    special = special_token_ids(tokenizer)
    return next((i for i in after if i in special), None)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def checkpoint_eos_ids(model_dir: str | None) -> list[int]:
    """`eos_token_id` of the checkpoint's generation_config.json (an int or a list), [] without one."""
    if not model_dir or not (Path(model_dir) / "generation_config.json").is_file():
        return []
    from transformers import GenerationConfig

    return _as_list(GenerationConfig.from_pretrained(model_dir).eos_token_id)


def derive_stop_tokens(tokenizer, model_dir: str | None, chat: bool) -> StopTokens:
    found: dict[int, str] = {}  # the end of turn before the checkpoint's list, which often names it too
    for name, ids in (("eos", _as_list(tokenizer.eos_token_id)),
                      ("end of turn", _as_list(end_of_turn_id(tokenizer) if chat else None)),
                      ("generation_config", checkpoint_eos_ids(model_dir))):
        for i in ids:
            found.setdefault(i, name)
    if not found:
        raise ValueError("the tokenizer has no eos token and the checkpoint's generation_config.json names none: "
                         "set eos_token in the tokenizer's tokenizer_config.json")
    end_of_turn = next((i for i, name in found.items() if name == "end of turn"), None)
    if chat and end_of_turn is None:
        end_of_turn = end_of_turn_id(tokenizer)  # already an eos: still the turn's end
    return StopTokens(tuple(found), tuple(found.values()), end_of_turn)
