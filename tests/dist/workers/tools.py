"""Tools and environments the tool-calling tests name by `module:attribute` (TRL's contract: type hints and a
Google-style docstring; an environment's public methods are its tools)."""

from __future__ import annotations

import time


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: x
        b: y
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


async def add_later(a: int, b: int) -> str:
    """Add two integers, asynchronously.

    Args:
        a: the first integer
        b: the second integer
    """
    return str(a + b)


def hang(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "woke"


def undocumented(a: int) -> int:
    return a


class Counter:
    """An environment: `reset` receives the row and may add text to the prompt; its tool counts; the reward is the
    count."""

    built = 0  # instances made so far (the pool builds one only when a batch needs more)

    def __init__(self):
        Counter.built += 1
        self.count = 0
        self.target = None

    def reset(self, **row) -> str | None:
        self.count, self.target = 0, row.get("target")
        return None if self.target is None else f" (target {self.target})"

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: the amount
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count == self.target)


def conversations() -> list[list[dict]]:
    """Two conversations that call `add` and answer with its result, in the chat template's format."""
    def call(a: int, b: int) -> dict:
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]}

    return [[{"role": "user", "content": f"add {a} and {b}"}, call(a, b),
             {"role": "tool", "name": "add", "content": str(a + b)}, {"role": "assistant", "content": str(a + b)}]
            for a, b in ((12, 34), (5, 7))]


def save_memorized_model(directory, steps: int = 100, seed: int = 0):
    """A tiny Llama of conf/model/tiny_llama.yaml's architecture (the session vLLM server's: its weights can be pushed
    there) trained to complete `conversations()` rendered with the tool `add` (its loss on what follows each prompt),
    saved with the shipped tokenizer: sampled at temperature 1 it calls the tools as the conversations do."""
    import torch
    import yaml
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.helpers import REPO, TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    rows = [tokenizer.apply_chat_template(c, tools=[add], tokenize=True, return_dict=True)["input_ids"]
            for c in conversations()]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.eos_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    torch.manual_seed(seed)
    sizes = yaml.safe_load((REPO / "conf" / "model" / "tiny_llama.yaml").read_text())["from_config"]
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **{k: v for k, v in sizes.items()
                                                                       if k != "model_type"}))
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    prompt = [len(tokenizer.apply_chat_template(c[:1], tools=[add], add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]) for c in conversations()]
    after_prompt = torch.arange(width)[None, :] >= torch.tensor(prompt)[:, None]  # the completion only
    labels = ids.masked_fill((mask == 0) | ~after_prompt, -100)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return float(loss.detach())


def exact(prompts: list, responses: list[str], response: list[str] | None = None, **_) -> list[float]:
    """1 for the reference answer (the `response` column), else 0."""
    return [float(r.strip() == str(t).strip()) for r, t in zip(responses, response)]
