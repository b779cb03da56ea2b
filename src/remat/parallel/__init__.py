"""torch.distributed layouts for models with Sites, run under torchrun (never a home-made
distributed layer): FSDP2 data parallelism today."""
from remat.parallel.data_parallel import fully_shard_layers, layer_modules

__all__ = ["fully_shard_layers", "layer_modules"]
