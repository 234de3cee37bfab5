"""`python -m llmtrain recipe=NAME key=value ...`: compose the config, then run it."""

from __future__ import annotations

import logging
import sys

from llmtrain.config import ConfigError


def _strip_launcher_args(argv: list[str]) -> list[str]:
    """The deepspeed launcher appends --local_rank=N (LOCAL_RANK is in the environment too)."""
    return [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]


def main(argv: list[str] | None = None) -> int:
    from llmtrain.compose import compose_config
    from llmtrain.data.errors import DataConfigError
    from llmtrain.trainer import NonFiniteError
    from llmtrain.parallel import env_rank
    from llmtrain.run import run

    logging.basicConfig(level=logging.INFO if env_rank() == 0 else logging.WARNING,
                        format=f"[rank{env_rank()}] %(levelname)s %(name)s: %(message)s")
    try:
        cfg = compose_config(_strip_launcher_args(sys.argv[1:] if argv is None else argv))
        run(cfg)
    except (ConfigError, DataConfigError, FileNotFoundError) as error:
        print(f"llmtrain: error on rank {env_rank()}: {error}", file=sys.stderr, flush=True)
        return 2
    except NonFiniteError as error:
        print(f"llmtrain: stopped on rank {env_rank()}: {error}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
