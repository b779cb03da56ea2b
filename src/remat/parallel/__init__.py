"""torch.distributed layouts for models with Sites, run under torchrun (never a home-made
distributed layer): FSDP2 data parallelism, expert parallelism within it, tensor (and sequence)
parallelism, pipeline parallelism and context parallelism."""
from remat.parallel.context_parallel import context_parallel_model, sharded
from remat.parallel.data_parallel import accumulate, fully_shard_layers, layer_modules
from remat.parallel.expert_parallel import ExpertSplit, parallelize_experts, shard_experts, split_experts
from remat.parallel.launch import (Coordinates, coordinates, device_mesh, is_main, launched_world, max_over_ranks,
                                   mean_over_ranks, of_highest_rank, rank, start, stop, torchrun, world_size)
from remat.parallel.pipeline import Pipeline, PipelineLayout, model_chunks
from remat.parallel.tensor_parallel import distribute_saved_inputs, parallelize_tensor

__all__ = ["Coordinates", "ExpertSplit", "Pipeline", "PipelineLayout", "accumulate", "context_parallel_model", "coordinates", "device_mesh",
           "distribute_saved_inputs", "fully_shard_layers", "is_main", "launched_world", "layer_modules",
           "max_over_ranks", "mean_over_ranks", "model_chunks", "of_highest_rank", "parallelize_experts",
           "parallelize_tensor", "rank", "shard_experts", "sharded", "split_experts", "start", "stop", "torchrun",
           "world_size"]
