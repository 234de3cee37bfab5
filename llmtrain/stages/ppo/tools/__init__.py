"""Multi-turn RL with tools and environments, as TRL 1.16's GRPOTrainer takes them (`tools`, `environment_factory`):
loading.py (the user's functions and factories, the environment pool, get_reward as a reward source), executor.py
(running calls: TRL's error conventions plus a timeout), parsing.py (the chat template's side), multiturn.py (the
loop on the hf or the vLLM engine, token-exact trajectories with the model's-own-token mask; with vLLM also requested
ahead, ppo.off_policy)."""

from __future__ import annotations

import inspect
from typing import Any

from llmtrain.config import ConfigError
from llmtrain.losses.advantages import needs_critic


def uses_tools(p: Any) -> bool:
    return bool(list(p.tools)) or p.environment is not None


def tool_problems(p: Any) -> list[str]:
    """ppo.tools, ppo.environment and their settings; the user's modules are imported here, before any model loads
    (a factory that does not import, or a tool transformers cannot describe, is named with its field)."""
    from llmtrain.stages.ppo.tools.loading import environment_specs, load_attribute, load_tools, schema_problem

    problems = []
    if not p.tool_timeout_s > 0:
        problems.append(f"ppo.tool_timeout_s={p.tool_timeout_s} must be > 0 seconds (a tool that hangs must not hang "
                        "the run)")
    if p.max_tool_calling_iterations is not None and p.max_tool_calling_iterations < 0:
        problems.append(f"ppo.max_tool_calling_iterations={p.max_tool_calling_iterations} must be >= 0 (or null: "
                        "until a turn calls no tool)")
    if p.max_tokens_per_turn is not None and not 1 <= p.max_tokens_per_turn <= p.rollout.max_new_tokens:
        problems.append(f"ppo.max_tokens_per_turn={p.max_tokens_per_turn} must be in [1, ppo.rollout.max_new_tokens="
                        f"{p.rollout.max_new_tokens}] (or null)")
    if not uses_tools(p):
        return problems
    if needs_critic.get(p.advantage, False):
        problems.append(f"ppo.advantage={p.advantage} bootstraps each token's value from the next token's, which "
                        "in a tool-calling trajectory is a tool result's (not the model's next action): use a "
                        "critic-free estimator with ppo.tools / ppo.environment (grpo, rloo, reinforce_pp...)")
    if p.environment is not None and getattr(p.reward, "url", None) is not None:
        problems.append("ppo.reward.url sends each row's columns as JSON, and with ppo.environment the rows carry "
                        "their environment instances (TRL's `environments`), which are not JSON: score with the "
                        "environment's get_reward or a reward function, or drop ppo.environment")
    if isinstance(p.environment, (list, tuple)) or (p.environment is not None and not isinstance(p.environment, str)
                                                   and not hasattr(p.environment, "items")):
        problems.append(f"ppo.environment={p.environment!r} must be module:factory or a dict name -> module:factory")
        return problems
    try:
        for function in load_tools(list(p.tools)):
            problems += [m for m in [schema_problem(function, "ppo.tools")] if m]
        for name, spec in environment_specs(p.environment).items():
            load_attribute(spec, "ppo.environment" if name is None else f"ppo.environment.{name}")
    except ConfigError as error:
        problems.append(str(error))
    return problems


def environment_owns_reward(p: Any) -> bool:
    """An environment defines get_reward: it is a reward source, and none other is required (TRL's rule)."""
    from llmtrain.stages.ppo.tools.loading import environment_specs, load_attribute

    try:
        factories = [load_attribute(spec, "ppo.environment") for spec in environment_specs(p.environment).values()]
    except (ConfigError, TypeError, AttributeError):
        return False  # reported by tool_problems
    # a class says so itself; a factory function is asked for one instance (TRL probes one as well)
    return any(callable(getattr(factory if inspect.isclass(factory) else factory(), "get_reward", None))
               for factory in factories)


def attach(stage, cfg, tokenizer) -> None:
    """With ppo.tools / ppo.environment: the stage samples through the multi-turn engine around its own, and each
    environment class with get_reward is one more reward source."""
    from llmtrain.stages.ppo.tools.loading import load_environments, load_tools
    from llmtrain.stages.ppo.tools.multiturn import MultiTurnEngine, ToolSettings

    p = cfg.ppo
    if not uses_tools(p):
        return
    environments = load_environments(p.environment)
    settings = ToolSettings(timeout_s=p.tool_timeout_s, max_iterations=p.max_tool_calling_iterations,
                            max_tokens_per_turn=p.max_tokens_per_turn)
    stage.rollout_engine = MultiTurnEngine(stage.rollout_engine, tokenizer, load_tools(list(p.tools)), environments,
                                           settings)
    if stage.off_policy is not None:  # rollouts requested ahead: the whole multi-turn loop of each in flight
        stage.off_policy.engine = stage.rollout_engine
    if environments is not None:
        stage.reward_functions = list(stage.reward_functions) + environments.reward_functions()
