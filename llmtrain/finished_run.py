"""A finished run read back for inspection (the notebooks): its resolved config, its exported models, and its held-out
examples tokenised exactly as the run tokenised them, scored one sample (or pair) at a time.

    run = FinishedRun("runs/sft_tiny")
    samples = run.token_losses()        # SFT / pretrain: per-token loss of every held-out sample
    pairs = run.pair_rewards()          # preference stages: r_chosen, r_rejected of every held-out pair
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from llmtrain.data.collate import Batch, collate
from llmtrain.losses.dpo import sequence_logps, token_logps
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.stages.registry import load_stage_data, stage_spec, stage_specs


@dataclass
class TokenLosses:
    """One held-out sample: its tokens, which of them are targets, and the loss of predicting each."""
    input_ids: list[int]  # (T,)
    is_target: list[bool]  # (T,) token t carries a loss (SFT: the response; its first token never does)
    losses: list[float]  # (T,) -log p(token t | tokens < t); 0.0 where not a target

    @property
    def num_targets(self) -> int:
        return sum(self.is_target)

    @property
    def loss_sum(self) -> float:
        return sum(self.losses)


@dataclass
class PairReward:
    """One held-out preference pair: the reward of each side (a reward model's score at the EOS, or DPO's implicit
    reward β·(log π − log π_ref) of the response), its kind ("easy", "hard" or None) and its texts."""
    chosen: float
    rejected: float
    kind: str | None
    chosen_text: str
    rejected_text: str

    @property
    def margin(self) -> float:
        return self.chosen - self.rejected


class FinishedRun:
    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        config = self.dir / "config.yaml"
        if not config.is_file():
            raise FileNotFoundError(f"{config} is missing: {self.dir} is not an llmtrain run directory")
        self.cfg: DictConfig = OmegaConf.load(config)
        self.stage = self.cfg.stage.name
        self.spec = stage_spec(self.stage)

    def export_dir(self) -> Path:
        export = self.dir / "hf"
        if not (export / "config.json").is_file():
            raise FileNotFoundError(f"{export} holds no exported model: the run has not finished (it exports at the "
                                    f"end of trainer.max_steps)")
        return export

    def tokenizer(self):
        from llmtrain.models.load import load_tokenizer

        return load_tokenizer(str(self.export_dir()), self.cfg.model.trust_remote_code)

    def model(self, directory: str | Path | None = None, head: str = "lm") -> torch.nn.Module:
        """The exported model (or the one in `directory`) in fp32, eval mode; head "scalar": a reward model."""
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        cls = AutoModelForSequenceClassification if head == "scalar" else AutoModelForCausalLM
        return cls.from_pretrained(directory or self.export_dir(), dtype=torch.float32,
                                   trust_remote_code=self.cfg.model.trust_remote_code).eval()

    def initial_model(self) -> torch.nn.Module:
        """The model the run started from (DPO's frozen reference): model.name_or_path."""
        source = self.cfg.model.name_or_path
        if not source or not Path(source).is_dir():
            raise FileNotFoundError(f"model.name_or_path={source!r} is not a local directory: the run's initial "
                                    f"weights cannot be loaded back (a model.from_config run starts from random ones)")
        return self.model(source)

    def held_out(self, tokenizer):
        """The run's eval examples (its train examples if it had none), unpacked: one sample or pair each."""
        cfg = OmegaConf.merge(self.cfg, {"data": {"packing": False}})
        data = load_stage_data(cfg, tokenizer)
        return data.eval if data.eval is not None else data.train

    @torch.no_grad()
    def token_losses(self, batch_size: int = 32) -> list[TokenLosses]:
        if not self.spec.token_losses:
            raise ValueError(f"token losses are for the {_stages_with('token_losses')} stages; this run is "
                             f"stage={self.stage}")
        tokenizer, model = self.tokenizer(), self.model()
        samples = []
        for rows in chunks(self.held_out(tokenizer), batch_size):
            batch = collate(rows, tokenizer.pad_token_id)  # right-padded, as the run's eval
            losses = per_token_losses(model(**batch.model_inputs()).logits, batch.labels)  # (B, T)
            for row, loss in zip(rows, losses):
                length = len(row["input_ids"])
                is_target = [label != IGNORE_INDEX for label in row["labels"]]
                is_target[0] = False  # nothing predicts the first token
                samples.append(TokenLosses(list(row["input_ids"]), is_target, loss[:length].tolist()))
        return samples

    @torch.no_grad()
    def pair_rewards(self, batch_size: int = 32) -> list[PairReward]:
        if self.spec.pair_scores is None:
            raise ValueError(f"pair rewards are for the {_stages_with('pair_scores')} stages; this run is "
                             f"stage={self.stage}")
        tokenizer = self.tokenizer()
        score = self._reward_model_scores() if self.spec.pair_scores == "scalar" else self._implicit_rewards()
        pairs = []
        held_out = self.held_out(tokenizer)
        if self.spec.unpaired:  # KTO's rows unpaired from held-out pairs: paired again
            from llmtrain.data.unpaired_format import pairs_of

            held_out = pairs_of(held_out)
        for rows in chunks(held_out, batch_size):
            sides = [{"input_ids": r[f"{side}_input_ids"], "labels": r[f"{side}_labels"]}
                     for side in ("chosen", "rejected") for r in rows]
            rewards = score(collate(sides, tokenizer.pad_token_id)).tolist()  # (2P,): chosen, then rejected
            for i, row in enumerate(rows):
                pairs.append(PairReward(rewards[i], rewards[len(rows) + i], row.get("kind"),
                                        tokenizer.decode(row["chosen_input_ids"]),
                                        tokenizer.decode(row["rejected_input_ids"])))
        return pairs

    def _reward_model_scores(self):
        model = self.model(head="scalar")  # transformers pools at each row's last real token: the EOS

        def score(batch: Batch) -> torch.Tensor:
            return model(**batch.model_inputs()).logits[:, 0].float()

        return score

    def _implicit_rewards(self):
        """β · (log π − log π_ref) of each response (DPO), or β · log π without a reference (SimPO, ORPO)."""
        how = self.spec.implicit_reward(self.cfg)
        models = (self.model(), self.initial_model()) if how.reference else (self.model(),)

        def score(batch: Batch) -> torch.Tensor:
            logps = [sequence_logps(model(**batch.model_inputs()).logits, batch.labels, average=how.averaged)
                     for model in models]
            return how.beta * (logps[0] - logps[1] if how.reference else logps[0])

        return score


def _stages_with(hook: str) -> str:
    return ", ".join(name for name, spec in stage_specs().items() if getattr(spec, hook))


def chunks(examples, size: int):
    """Lists of `size` consecutive examples (the last one shorter)."""
    for start in range(0, len(examples), size):
        yield [examples[i] for i in range(start, min(start + size, len(examples)))]


def per_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, T) −log p(token t | tokens < t) at each target t, 0 elsewhere (position 0 is never a target).

    logits: (B, T, V), labels: (B, T) aligned with the tokens."""
    logps, _ = token_logps(logits, labels)  # (B, T): position t's log-prob of token t + 1
    return F.pad(-logps[:, :-1], (1, 0))
