"""A finished run read back for inspection (the notebooks): its resolved config, its exported models, and its held-out
examples tokenised exactly as the run tokenised them, scored one sample (or pair) at a time.

    run = FinishedRun("runs/sft_tiny")
    samples = run.token_losses()        # SFT / pretrain: per-token loss of every held-out sample
    pairs = run.pair_rewards()          # reward model or DPO: r_chosen, r_rejected of every held-out pair
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from llmtrain.losses.lm import IGNORE_INDEX

PREFERENCE_STAGES = ("reward", "dpo")


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
        from llmtrain.run import load_data

        cfg = OmegaConf.merge(self.cfg, {"data": {"packing": False}})
        data = load_data(cfg, tokenizer)
        return data.eval if data.eval is not None else data.train

    @torch.no_grad()
    def token_losses(self, batch_size: int = 32) -> list[TokenLosses]:
        if self.stage not in ("sft", "pretrain"):
            raise ValueError(f"token losses are for the sft and pretrain stages; this run is stage={self.stage}")
        tokenizer, model = self.tokenizer(), self.model()
        examples = self.held_out(tokenizer)
        samples = []
        for start in range(0, len(examples), batch_size):
            rows = [examples[i] for i in range(start, min(start + batch_size, len(examples)))]
            ids, labels, mask = right_padded([r["input_ids"] for r in rows], [r["labels"] for r in rows],
                                             tokenizer.pad_token_id)
            losses = target_logps(model(input_ids=ids, attention_mask=mask).logits, labels).neg()  # (B, T)
            for row, loss in zip(rows, losses):
                length = len(row["input_ids"])
                is_target = [label != IGNORE_INDEX for label in row["labels"]]
                is_target[0] = False  # nothing predicts the first token
                samples.append(TokenLosses(list(row["input_ids"]), is_target, loss[:length].tolist()))
        return samples

    @torch.no_grad()
    def pair_rewards(self, batch_size: int = 32) -> list[PairReward]:
        if self.stage not in PREFERENCE_STAGES:
            raise ValueError(f"pair rewards are for the {' and '.join(PREFERENCE_STAGES)} stages; this run is "
                             f"stage={self.stage}")
        tokenizer = self.tokenizer()
        examples = self.held_out(tokenizer)
        score = self._reward_model_scores() if self.stage == "reward" else self._dpo_rewards()
        pairs = []
        for start in range(0, len(examples), batch_size):
            rows = [examples[i] for i in range(start, min(start + batch_size, len(examples)))]
            sides = [(r[f"{side}_input_ids"], r[f"{side}_labels"]) for side in ("chosen", "rejected") for r in rows]
            ids, labels, mask = right_padded(*zip(*sides), tokenizer.pad_token_id)
            rewards = score(ids, labels, mask).tolist()  # (2P,): chosen, then rejected
            for i, row in enumerate(rows):
                pairs.append(PairReward(rewards[i], rewards[len(rows) + i], row.get("kind"),
                                        tokenizer.decode(row["chosen_input_ids"]),
                                        tokenizer.decode(row["rejected_input_ids"])))
        return pairs

    def _reward_model_scores(self):
        model = self.model(head="scalar")  # transformers pools at each row's last real token: the EOS

        def score(ids, labels, mask):
            return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()

        return score

    def _dpo_rewards(self):
        policy, reference = self.model(), self.initial_model()
        beta, averaged = self.cfg.dpo.beta, self.cfg.dpo.loss == "ipo"

        def logps(model, ids, labels, mask):
            per_token = target_logps(model(input_ids=ids, attention_mask=mask).logits, labels)  # (B, T)
            total = per_token.sum(-1)
            return total / (labels[:, 1:] != IGNORE_INDEX).sum(-1).clamp(min=1) if averaged else total

        def score(ids, labels, mask):
            return beta * (logps(policy, ids, labels, mask) - logps(reference, ids, labels, mask))

        return score


def right_padded(input_ids, labels, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of different lengths -> ids (B, T) padded with the pad token, labels (B, T) with IGNORE_INDEX, mask."""
    width = max(len(row) for row in input_ids)
    ids = torch.tensor([list(row) + [pad_token_id] * (width - len(row)) for row in input_ids])
    targets = torch.tensor([list(row) + [IGNORE_INDEX] * (width - len(row)) for row in labels])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in input_ids])
    return ids, targets, mask


def target_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, T) log p(label t | tokens < t) at each target position t, 0 elsewhere (position 0 is never a target).

    logits: (B, T, V), labels: (B, T) aligned with the tokens."""
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V): position t-1 predicts token t
    targets = labels[:, 1:]  # (B, T-1)
    picked = logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T-1)
    return F.pad(picked.masked_fill(targets == IGNORE_INDEX, 0.0), (1, 0))
