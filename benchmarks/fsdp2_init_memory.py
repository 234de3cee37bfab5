"""Peak host memory (RSS) per rank of backend=fsdp2 on 2 ranks, for a ~100M-parameter Llama built from a
config: how much the model build costs each rank, and the whole run (init + a few steps + HF export).

    python benchmarks/fsdp2_init_memory.py [--nproc 2] [--steps 3] [--layers 16]

Each rank runs llmtrain's own entry point (`llmtrain.__main__.main`) under torchrun in this file's
`--worker` mode and writes its peak RSS (`ru_maxrss`) at four points: before the model is built
(imports, tokenizer, data: the baseline), right after `backend.wrap` returns (the model is built,
sharded and holds its weights on every rank: the init peak), after the training steps, and at exit
(after the HF export, which gathers the full model to rank 0). Before
meta-device init every rank built the whole fp32 model (4 bytes × params) before sharding it; after it,
only rank 0 does.

Measured (2 CPU cores, torch 2.13.0+cpu, gloo, 101.1M parameters = 386 MiB in fp32; MiB, 3 runs each):
growth from "before build" to "after wrap" — before: rank 0 403, rank 1 403 (a full copy each);
after: rank 0 587 (the full copy + its shard, held together until the load ends), rank 1 210-213 (its
half, 193, + one tensor in flight). The run's peak (~2.1-2.9 GiB per rank, noisy) comes from the CPU
training steps (params + grads + Adam shards, foreach temporaries) and did not change: on 2 CPU ranks
the optimizer state outweighs one model copy; on GPUs that state is in device memory and the host
peak is the init one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(out_dir: Path, argv: list[str]) -> None:
    from llmtrain.__main__ import main
    from llmtrain.backends import fsdp2
    from llmtrain.trainer import Trainer

    report = {"rank": int(os.environ["RANK"])}
    wrap, init_context, fit = fsdp2.FSDP2Backend.wrap, fsdp2.FSDP2Backend.model_init_context, Trainer.fit

    def measured_init_context(self):
        report["before_build_peak_rss"] = peak_rss_bytes()
        return init_context(self)

    def measured_fit(self):
        fit(self)
        report["fit_peak_rss"] = peak_rss_bytes()

    def measured_wrap(self, model, optim):
        engine = wrap(self, model, optim)
        report["parameters"] = sum(p.numel() for p in model.parameters())  # global sizes (DTensors)
        report["init_peak_rss"] = peak_rss_bytes()
        return engine

    fsdp2.FSDP2Backend.wrap, fsdp2.FSDP2Backend.model_init_context = measured_wrap, measured_init_context
    Trainer.fit = measured_fit
    code = main(argv)
    report["run_peak_rss"] = peak_rss_bytes()
    (out_dir / f"rank_{report['rank']}.json").write_text(json.dumps(report))
    sys.exit(code)


def llm_args(out_dir: Path, steps: int, layers: int) -> list[str]:
    model = (f"{{model_type:llama,hidden_size:768,intermediate_size:2048,num_hidden_layers:{layers},"
             "num_attention_heads:12,num_key_value_heads:4,max_position_embeddings:512,"
             "tie_word_embeddings:false}")
    return ["recipe=sft_tiny", "backend=fsdp2", f"model.from_config={model}", f"output_dir={out_dir / 'run'}",
            f"trainer.max_steps={steps}", "trainer.micro_batch_size=2", "trainer.grad_accum_steps=1",
            "trainer.eval_every_n_steps=0", "trainer.save_every_n_steps=0", "trainer.log_every_n_steps=0",
            "data.eval_files=[]", "data.max_seq_len=64", "precision=fp32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16, help="16: 100.8M parameters")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               "-m", "benchmarks.fsdp2_init_memory", "--worker", str(out), "--",
               *llm_args(out, args.steps, args.layers)]
        env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
        reports = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(args.nproc)]
    params = reports[0]["parameters"]
    print(f"Llama {params / 1e6:.1f}M parameters (full fp32 copy {4 * params / MIB:.0f} MiB), "
          f"backend=fsdp2, {args.nproc} ranks, {args.steps} steps")
    columns = {"before_build_peak_rss": "before build", "init_peak_rss": "after wrap", "fit_peak_rss": "after steps",
               "run_peak_rss": "at exit"}
    print("peak RSS (MiB) " + "".join(f"{title:>14}" for title in columns.values()) + "   wrap - before build")
    for r in reports:
        print(f"rank {r['rank']:<9} " + "".join(f"{r[key] / MIB:>14.0f}" for key in columns)
              + f"   {(r['init_peak_rss'] - r['before_build_peak_rss']) / MIB:>19.0f}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[4:])  # argv: --worker OUT -- llmtrain overrides
    else:
        main()
