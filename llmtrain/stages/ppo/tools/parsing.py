"""The chat template's side of a tool-calling rollout: prompts rendered with the tools, the model's turns parsed with
TRL's response parsers (trl/chat_template_utils.py: Qwen2.5/3, Llama 3.1/3.2, GLM-4-MoE, GPT-OSS, ...), and the
tokens of tool results as the template renders them after the model's turn.

The tiny tokenizer (llmtrain/assets/tokenizer) renders tool calls in Qwen3's format inside its own turn markers
(`<|assistant|>\\n` ... `<|end|>`): it gets TRL's Qwen3 response template with those two anchors swapped, the same
parser otherwise.
"""

from __future__ import annotations

import copy

from llmtrain.config import ConfigError
from llmtrain.models.tiny_tokenizer import CHAT_TEMPLATE as TINY_TEMPLATE


def tiny_response_template() -> dict:
    from trl.chat_template_utils import qwen3_template

    template = copy.deepcopy(qwen3_template)
    template["start_anchor"] = "<|assistant|>\n"
    template["fields"]["content"]["close_pattern"] = r"<\|end\|>\s*"
    return template


def with_response_parser(tokenizer):
    """The tokenizer with a response template TRL's parse_response reads (kept when it has one already)."""
    if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None):
        return tokenizer
    if getattr(tokenizer, "chat_template", None) == TINY_TEMPLATE:
        tokenizer.response_template = tiny_response_template()
        return tokenizer
    from trl.chat_template_utils import add_response_schema

    try:
        return add_response_schema(tokenizer)
    except ValueError as error:
        raise ConfigError(f"ppo.tools / ppo.environment: the model's chat template is not one TRL can parse tool calls "
                          f"from ({error}); use a tokenizer whose template is one of trl/chat_templates (Qwen2.5/3, "
                          "Llama 3.1/3.2, GLM-4-MoE, GPT-OSS, ...) or set its response_template") from error


def prompt_ids(tokenizer, messages: list[dict], tools: list) -> list[int]:
    """The prompt's tokens: the chat template with the tools and the generation prompt (as TRL's _tokenize_prompts;
    `tools or None`: Llama renders tool boilerplate for an empty list)."""
    rendered = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                             tokenize=True, return_dict=True)
    return list(rendered["input_ids"])


def tool_suffix_ids(tokenizer, tool_messages: list[dict], stop_ids: list[int]) -> list[int]:
    """The tokens the template puts after a model turn that ends in a stop token: the tool messages and the next
    generation prompt (TRL's _get_tool_suffix_ids, on a dummy conversation; the prefix is cut after its last stop
    token, the end of turn the model itself generates, where TRL cuts after the last eos)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = list(tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True,
                                                return_dict=True)["input_ids"])
    full = list(tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
    stops = [i for i, token in enumerate(prefix) if token in stop_ids]
    if stops:
        prefix = prefix[:stops[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ValueError("the chat template does not render a tool message after the assistant's turn as a suffix "
                         "of that turn (not prefix-preserving): tool results cannot be appended token-exactly")
    return full[len(prefix):]


def parsed_turn(tokenizer, ids: list[int], prefix: list[int], tools: list) -> dict:
    """A model turn's tokens -> {"role": "assistant", "content", "tool_calls"?} (TRL's parse_response: malformed
    calls fall back to plain content)."""
    from trl.chat_template_utils import parse_response

    return parse_response(tokenizer, ids, prefix=prefix, tools=tools or None)
