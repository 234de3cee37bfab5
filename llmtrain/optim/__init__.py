"""The optimizers every backend builds (`optim.name`): AdamW, and Muon for the hidden matrices with AdamW for the
rest (the Moonlight recipe). One builder (`build.build_optimizer`) for DDP, DeepSpeed ZeRO-0/1/2/3 and FSDP2; the
sharded backends hand the Muon update the whole matrix (`muon.py`, `zero_layout.py`). `spec.py` is pure Python:
the config checks and the planner's per-parameter figures, importable without torch.
"""
