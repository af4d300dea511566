"""Capacity planner: will a model fit on these GPUs, and how much KV cache is left.

``plan(Deployment(...))`` gives the per-rank plan (or a refusal with numbers and remedy);
``num_kv_blocks(...)`` is the same arithmetic for a worker sizing its cache from measured free memory;
``StepCostModel`` gives the simulated backend its step times.
"""

from stride.planner.cost import StepCost, StepCostModel
from stride.planner.formats import WeightFormat, kv_dtype_bytes, weight_format
from stride.planner.geometry import CATALOG, ModelGeometry, load_geometry
from stride.planner.hardware import GPUS, GpuSpec, get_gpu
from stride.planner.memory import (
    activation_reserve_bytes,
    decode_graph_reserve_bytes,
    expansion_scratch_bytes,
    num_kv_blocks,
)
from stride.planner.parallel import Parallelism, check_parallelism, rank_weight_bytes
from stride.planner.plan import Deployment, Plan, plan

__all__ = [
    "CATALOG", "GPUS", "Deployment", "GpuSpec", "ModelGeometry", "Parallelism", "Plan", "StepCost",
    "StepCostModel", "WeightFormat", "activation_reserve_bytes", "check_parallelism", "decode_graph_reserve_bytes",
    "expansion_scratch_bytes", "get_gpu",
    "kv_dtype_bytes", "load_geometry", "num_kv_blocks", "plan", "rank_weight_bytes", "weight_format",
]
