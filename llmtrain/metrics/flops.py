"""Training FLOPs per token (docs/formulas.md) and human-readable units for the plan."""

from __future__ import annotations


def training_flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Model FLOPs of forward + backward per token: 6·M for the weights plus the attention score and
    value products, 12·L·h·s (from L·(72bsh² + 12bs²h) per step; s is the full row length, an upper bound
    for rows that are shorter)."""
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_len


def human(value: float, unit: str = "", base: int = 1000) -> str:
    prefixes = ["", "K", "M", "G", "T", "P"] if base == 1000 else ["", "Ki", "Mi", "Gi", "Ti", "Pi"]
    for prefix in prefixes:
        if abs(value) < base or prefix == prefixes[-1]:
            return f"{value:,.1f} {prefix}{unit}".rstrip()
        value /= base
    return f"{value:,.1f} {unit}"
