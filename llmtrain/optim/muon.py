"""Muon for the hidden matrices, AdamW for the rest, in one torch optimizer (`MuonAdamW`) every backend steps.

The Muon update is torch.optim.Muon's, line for line, and calls torch's own Newton-Schulz
(`torch.optim._muon._zeropower_via_newtonschulz`, which runs in bf16) and lr adjustment: one process equals
torch.optim.Muon bit for bit. The iteration needs the whole matrix, so a sharded parameter's update is made whole
first (`Piece`s): the momentum and Nesterov blend are elementwise and stay on the local shard; the blended
update is all-gathered, orthogonalised on every rank, and each rank keeps its own slice of the result.
- plain tensor (DDP, ZeRO-0, one process): the matrix itself;
- DTensor (FSDP2, with tp): `full_tensor()`, then the local shard of the result by DTensor's own Replicate ->
  placements redistribution (a local slice, no communication), so uneven and 2-D (dp, tp) shards follow FSDP's;
- a DeepSpeed ZeRO flat partition: a layout from `zero_layout.py` (set in `layouts` by the backend).
A 3-D MoE weight (E, m, n) (optim.muon.experts=per_matrix) is E matrices: Newton-Schulz on each, lr adjusted by (m, n).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

# (param view to update, its slice of the orthogonalised update, the shape of one matrix for the lr adjustment)
Piece = tuple[torch.Tensor, torch.Tensor, tuple[int, int]]


def orthogonalize(update: torch.Tensor, group: dict) -> torch.Tensor:
    """torch's Newton-Schulz on a whole 2-D matrix, or on each matrix of a 3-D (E, m, n) expert weight."""
    args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
    if update.ndim == 3:
        return torch.stack([_zeropower_via_newtonschulz(m, *args) for m in update])
    return _zeropower_via_newtonschulz(update, *args)


def _matrix_shape(shape: torch.Size | tuple) -> tuple[int, int]:
    return tuple(shape[-2:])


def dtensor_pieces(param, update, group: dict) -> Iterator[Piece]:
    """FSDP2 / tp: gather the update whole, orthogonalise, keep this rank's shard of it."""
    ortho = orthogonalize(update.full_tensor(), group)
    mesh = param.device_mesh
    whole = DTensor.from_local(ortho, mesh, [Replicate()] * mesh.ndim, run_check=False)
    yield param.to_local(), whole.redistribute(mesh, param.placements).to_local(), _matrix_shape(param.shape)


def local_pieces(param, update, group: dict) -> Iterator[Piece]:
    yield param, orthogonalize(update, group), _matrix_shape(param.shape)


class MuonAdamW(torch.optim.AdamW):
    """torch.optim.AdamW for the groups without `muon: True`; torch.optim.Muon's update for those with it (their
    `eps` is Muon's, and they carry momentum, nesterov, ns_coefficients, ns_steps, adjust_lr_fn). One optimizer, so
    the schedulers, grad scalers, DeepSpeed's wrappers and DCP see what they see of AdamW. Muon state: one
    `momentum_buffer` per parameter (AdamW: exp_avg, exp_avg_sq, step)."""

    def __init__(self, groups: list[dict], **adamw_defaults):
        super().__init__(groups, **adamw_defaults)
        self.layouts: dict[int, object] = {}  # id(flat ZeRO partition) -> its layout (zero_layout.py)

    def __setstate__(self, state: dict) -> None:
        # Adam's checks every state for its "step" (load_state_dict comes here): Muon's state has none.
        groups = state["param_groups"]
        state["param_groups"] = [g for g in groups if not g.get("muon")]
        super().__setstate__(state)
        self.param_groups = state["param_groups"] = groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        adam = [g for g in groups if not g.get("muon")]
        if adam:
            self.param_groups = adam  # AdamW's own step over its groups only (DeepSpeed steps groups so too)
            try:
                super().step()
            finally:
                self.param_groups = groups
        for group in groups:
            if group.get("muon"):
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            buf, grad = state["momentum_buffer"], param.grad
            buf.lerp_(grad, 1 - momentum)  # elementwise: the same on a shard as on the whole
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            for view, ortho, shape in self._pieces(param, update, group):
                view.mul_(1 - lr * decay)
                view.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))

    def _pieces(self, param, update, group: dict) -> Iterator[Piece]:
        layout = self.layouts.get(id(param))
        if layout is not None:
            return layout.pieces(param, update, group)
        if isinstance(param, DTensor):
            return dtensor_pieces(param, update, group)
        return local_pieces(param, update, group)
