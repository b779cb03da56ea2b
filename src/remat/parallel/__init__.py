"""torch.distributed layouts for models with Sites, run under torchrun (never a home-made
distributed layer): FSDP2 data parallelism, expert parallelism within it, tensor (and sequence)
parallelism, pipeline parallelism and context parallelism; `parallelize` composes them for a
`ParallelLayout`, and `parallelize_by_shape` is its twin on one rank's shard on the meta device."""

from remat.parallel.context_parallel import context_parallel_model, sharded
from remat.parallel.data_parallel import accumulate, fully_shard_layers, layer_modules
from remat.parallel.expert_parallel import ExpertSplit, parallelize_experts, shard_experts, split_experts
from remat.parallel.launch import (
    is_main,
    launched_world,
    max_over_ranks,
    mean_over_ranks,
    of_highest_rank,
    rank,
    start,
    stop,
    torchrun,
    world_size,
)
from remat.parallel.parallelize import Sharding, parallelize, parallelize_by_shape
from remat.parallel.pipeline import Pipeline, model_chunks
from remat.parallel.tensor_parallel import distribute_saved_inputs, parallelize_tensor

__all__ = [
    "ExpertSplit",
    "Pipeline",
    "Sharding",
    "accumulate",
    "context_parallel_model",
    "distribute_saved_inputs",
    "fully_shard_layers",
    "is_main",
    "launched_world",
    "layer_modules",
    "max_over_ranks",
    "mean_over_ranks",
    "model_chunks",
    "of_highest_rank",
    "parallelize",
    "parallelize_by_shape",
    "parallelize_experts",
    "parallelize_tensor",
    "rank",
    "shard_experts",
    "sharded",
    "split_experts",
    "start",
    "stop",
    "torchrun",
    "world_size",
]
