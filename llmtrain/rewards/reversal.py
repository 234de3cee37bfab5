"""The reversal task's rule-based reward: 1 for the exact reversal, else partial credit for characters in place.

`score(prompts, responses, response=None)`: the reference answer comes from the dataset's `response` column when
the data has one, else from the prompt itself ("reverse: abc\\n" -> "cba"). Partial credit is half the share of
positions that hold the right character, over the longer of the two strings: a response of the right length with
one wrong character scores below any exact one, and padding a response with junk does not pay. A response cut
at max_new_tokens (no EOS) is penalised by the stage (ppo.reward.missing_eos_penalty), not here: the function
only sees the text.
"""

from __future__ import annotations

PREFIX = "reverse:"


def target_of(prompt: str) -> str:
    return prompt.strip().removeprefix(PREFIX).strip()[::-1]


def reversal_score(response: str, target: str) -> float:
    response = response.strip()
    if response == target:
        return 1.0
    longest = max(len(response), len(target), 1)
    in_place = sum(a == b for a, b in zip(response, target))
    return 0.5 * in_place / longest


def score(prompts: list[str], responses: list[str], response: list[str] | None = None, **_) -> list[float]:
    targets = response if response is not None else [target_of(p) for p in prompts]
    return [reversal_score(r, str(t).strip()) for r, t in zip(responses, targets)]
