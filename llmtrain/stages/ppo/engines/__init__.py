"""Rollout engines (`ppo.rollout.engine`), one protocol: `start(actor)`, `sync(actor, version) -> metrics` (the
policy's weights into the engine, verified), `generate(actor, prompts, sampling, ...) -> Rollout` (token ids and
the sampled log-probs), `after_rollout()`, `close()`.

- hf: the training model's own forward (stages/ppo/rollout.py), always on the current weights.
- vllm: vLLM servers in their own environment (engines/vllm.py), weights pushed before each rollout that needs them.
"""

from __future__ import annotations

from llmtrain.stages.ppo import rollout


class HFEngine:
    """The actor samples its own rollouts: nothing to start, nothing to sync."""

    def start(self, actor) -> None:
        del actor

    def sync(self, actor, version: str) -> dict:
        del actor, version
        return {}

    def generate(self, actor, batch, settings, **options) -> rollout.Rollout:
        return rollout.generate(actor, batch, settings, **options)

    def after_rollout(self) -> None:
        pass

    def close(self) -> None:
        pass


ROLLOUT_ENGINES = ("hf", "vllm")
