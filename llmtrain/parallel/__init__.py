"""The layout of a run: parallel dimensions (one module each, registered in dimension.py) and ParallelDims, the only
reader of their degrees. The process group's lifecycle lives apart (llmtrain/distributed.py)."""

from llmtrain.parallel import cp, dp, ep, pp, sp, tp  # noqa: F401  (registers the dimensions)
from llmtrain.parallel.dimension import (
    DIMENSIONS,
    PLANNED,
    Dimension,
    applied_in_order,
    degree_of,
    degrees_of,
    row_degrees,
)
from llmtrain.parallel.layout import ParallelDims, describe_degrees

__all__ = ["DIMENSIONS", "PLANNED", "Dimension", "ParallelDims", "applied_in_order", "degree_of", "degrees_of",
           "describe_degrees", "row_degrees"]
