"""torch.distributed layouts for models with Sites, run under torchrun (never a home-made
distributed layer): FSDP2 data parallelism today."""
from remat.parallel.data_parallel import fully_shard_layers, layer_modules
from remat.parallel.launch import (is_main, launched_world, max_over_ranks, mean_over_ranks, rank, start, stop,
                                   torchrun, world_size)

__all__ = ["fully_shard_layers", "is_main", "launched_world", "layer_modules", "max_over_ranks", "mean_over_ranks",
           "rank", "start", "stop", "torchrun", "world_size"]
