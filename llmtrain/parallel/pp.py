"""Pipeline parallelism (`backend.pp`): stages of the decoder's blocks, outermost in the mesh (stage peers exchange only
activations, point to point: the slowest links do). Ranks of one pipeline read the same examples. Applied last: the
pipeline engine (backends/pipeline_engine.py) splits the parallelized model into stages; its checks and the split
are backends/pipeline_checks.py, its planner terms plan/pp.py."""

from __future__ import annotations

from typing import Any

from llmtrain.parallel.dimension import Dimension, register, shared_rows


def problems(backend: Any, degrees: dict) -> list[str]:
    """What the pipeline does not combine with yet: sequence shards (sp, cp), and with a backend config at hand its
    schedule's fields and settings."""
    from llmtrain.backends.pipeline_checks import schedule_problems, unsupported_settings

    pp = degrees["pp"]
    if pp <= 1:
        return []
    found = [f"backend.pp={pp} with backend.{name}={degree}: pipeline stages over sequence shards are not supported "
             "yet (neither is tested with the other); use one of them" for name, degree in shared_rows(degrees).items()]
    return found if backend is None else found + schedule_problems(backend) + unsupported_settings(backend)


def arch_problems(backend: Any, dims: Any, arch: Any) -> list[str]:
    """Enough blocks for the stages, the names the split works on, no experts."""
    if dims.pp <= 1:
        return []
    from llmtrain.backends.pipeline import has_layer_stack
    from llmtrain.backends.pipeline_checks import model_problems
    from llmtrain.models.moe import expert_count

    return model_problems(backend, arch.num_hidden_layers, expert_count(arch) or 0, arch.model_type,
                          has_layer_stack(arch), tied=bool(getattr(arch, "tie_word_embeddings", False)))


def facts_problems(backend: Any, dims: Any, facts: Any) -> list[str]:
    from llmtrain.backends.pipeline_checks import model_problems

    return model_problems(backend, facts.layers, 0, facts.model_type) if dims.pp > 1 else []


PP = register(Dimension(name="pp", position=0, same_data=True, problems=problems,
                        arch_problems=arch_problems, facts_problems=facts_problems))
