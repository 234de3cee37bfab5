"""`python -m llmtrain recipe=NAME key=value ...`: compose the config, then run it."""

from __future__ import annotations

import logging
import os
import sys

from llmtrain.config import ConfigError


def _strip_launcher_args(argv: list[str]) -> list[str]:
    """The deepspeed launcher appends --local_rank=N (LOCAL_RANK is in the environment too)."""
    return [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]


def _first_comment(path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def usage() -> str:
    """`python -m llmtrain --help`: the recipes, the config groups and their options, where the fields are."""
    import yaml

    from llmtrain.paths import available_recipes, conf_dir, docs_page, recipes_dir

    root = conf_dir()
    defaults = {}
    for entry in yaml.safe_load((root / "config.yaml").read_text()).get("defaults", []):
        if isinstance(entry, dict):
            defaults.update(entry)
    lines = ["usage: python -m llmtrain recipe=NAME [GROUP=OPTION ...] [FIELD=VALUE ...]",
             "       torchrun --nproc_per_node N -m llmtrain recipe=NAME ...    (several processes or nodes)",
             "", "recipes (recipes/NAME.yaml; or recipe=/path/to/your_recipe.yaml):"]
    lines += [f"  {name:<15} {_first_comment(recipes_dir() / f'{name}.yaml')}" for name in available_recipes()]
    lines += ["", "config groups (conf/GROUP/OPTION.yaml; GROUP=OPTION swaps one, the command line wins over the "
              "recipe):"]
    for group in sorted(p for p in root.iterdir() if p.is_dir()):
        options = sorted(o.stem for o in group.glob("*.yaml"))
        default = f"  (base default: {defaults[group.name]})" if group.name in defaults else ""
        lines.append(f"  {group.name:<8} {', '.join(options)}{default}")
    lines += ["", "fields: FIELD=VALUE sets any field, e.g. trainer.max_steps=100 optim.lr=1e-3 data.packing=true",
              "  precision=bf16 backend.zero_stage=3 model.from_config.n_embd=64 (with model=tiny_gpt2) dry_run=true;",
              f"  every field, its default and the values it takes: {docs_page('reference/config.md')}",
              f"  recipes and the command line: {docs_page('guide/cli.md')}; everything else: {docs_page('index.md')}",
              "",
              "examples:", "  python -m llmtrain recipe=sft_tiny",
              "  python -m llmtrain recipe=sft_tiny model=tiny_qwen2 trainer.max_steps=100",
              "  python -m llmtrain recipe=sft_7b dry_run=true"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _strip_launcher_args(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        try:
            print(usage(), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader left; say nothing more
            sys.stdout = open(os.devnull, "w")
        return 0
    from llmtrain.compose import compose_config
    from llmtrain.data.errors import DataConfigError
    from llmtrain.distributed import env_rank
    from llmtrain.faults import CollectiveFailure
    from llmtrain.run import run
    from llmtrain.trainer import NonFiniteError

    logging.basicConfig(level=logging.INFO if env_rank() == 0 else logging.WARNING,
                        format=f"[rank{env_rank()}] %(levelname)s %(name)s: %(message)s")
    try:
        cfg = compose_config(args)
        run(cfg)
    except (ConfigError, DataConfigError, FileNotFoundError) as error:
        print(f"llmtrain: error on rank {env_rank()}: {error}", file=sys.stderr, flush=True)
        return 2
    except NonFiniteError as error:
        print(f"llmtrain: stopped on rank {env_rank()}: {error}", file=sys.stderr, flush=True)
        return 3
    except CollectiveFailure as error:
        print(f"llmtrain: error on {error}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # no interpreter teardown: freeing the process group would wait on the stalled peer (parallel.py)
        os._exit(4)
    return 0


if __name__ == "__main__":
    from llmtrain.distributed import exit_process

    exit_process(main())
