"""Initial weights that do not depend on the layout: each parameter drawn whole from a generator of
its own, seeded by the run's seed and the parameter's whole-model name, and this rank's share cut
from it. A pipeline stage then holds exactly the whole model's weights at its layers, a tensor- or
data-parallel rank (a DTensor shard) exactly its slice of them, and one process the same values.

A family initializes its models in its own way (`ModelFamily.reset_parameters`): rather than ask
each family for a per-parameter initializer, `seeded_parameters` intercepts the random fills the
family's code makes on a parameter (`nn.init.normal_`, `Tensor.uniform_`, ...) and runs each on
the whole tensor, under the parameter's own seed. Fills that are not random (ones, zeros, copies)
do the same on every shard anyway. A split that stores a whole tensor rearranged (Megatron's
[gate_0; up_0; gate_1; up_1] rows of a tensor-parallel SwiGLU) says how on the module holding it,
`module.whole_to_split[name]`, an in-place function of the whole tensor, applied before the cut.
A plain parameter holding a slice of a whole one (a tensor-parallel share kept as a local tensor,
as the MoE family's experts are) says which on the module holding it, `module.split_shares[name]`
(a `Share`). Weights a module draws itself from generators of its own (remat's routed experts,
seeded by layer and global expert index) pass through untouched: they read the same attributes.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from remat.models.family import Share, split_share

# The in-place random fills of torch's Tensor and nn.init, by name: the top-level call is the one
# intercepted (the fills nn.init calls inside run on the whole tensor, the mode off).
RANDOM_FILLS = frozenset(
    {
        "normal_",
        "uniform_",
        "trunc_normal_",
        "kaiming_normal_",
        "kaiming_uniform_",
        "xavier_normal_",
        "xavier_uniform_",
        "orthogonal_",
        "sparse_",
        "random_",
        "bernoulli_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
    }
)
_LAYER = re.compile(r"(^|\.)layers\.(\d+)(?=\.|$)")


def named_seed(seed: int, name: str) -> int:
    """The seed of what `name` names (a parameter by its whole-model name, a sequence): the same in every process and
    Python (not `hash`, which Python salts per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def whole_model_names(model: nn.Module, layers: Sequence[int]) -> dict[str, str]:
    """Each parameter's name in `model` (one model chunk) -> its name in the whole model. A chunk
    numbering its decoder layers from 0 (remat's stages) holds the whole model's `layers`; one
    numbering them as the whole model does (transformers' stages) keeps its names."""
    names = [name for name, _ in model.named_parameters()]
    numbers = {int(m.group(2)) for name in names for m in _LAYER.finditer(name)}
    positional = numbers == set(range(len(layers))) and list(layers) != list(range(len(layers)))

    def whole(name: str) -> str:
        if not positional:
            return name
        return _LAYER.sub(lambda m: f"{m.group(1)}layers.{layers[int(m.group(2))]}", name)

    return {name: whole(name) for name in names}


def _key(t: torch.Tensor) -> tuple[int, tuple[int, ...]] | None:
    """What identifies a parameter's storage through views of it (`p.data`, as transformers'
    initializers fill): its local data pointer and whole shape; None for an empty shard."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if local.numel() == 0 or local.is_meta:
        return None
    return local.data_ptr(), tuple(t.shape)


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    """The default generator of `device` seeded `seed` inside, restored after: torch's own seed
    (`initial_seed`, which other seeds derive from) and every other device stay as they were."""
    generator = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" else torch.default_generator
    state, initial = generator.get_state(), generator.initial_seed()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.manual_seed(initial)
        generator.set_state(state)


Rearrange = Callable[[torch.Tensor], None]
Key = tuple[int, tuple[int, ...]]


class _WholeFills(TorchFunctionMode):
    """Runs each random fill of a known parameter on the whole tensor under its own seed and
    copies this rank's share back (a DTensor's shard, cut where its placements put it)."""

    def __init__(self, seeds: dict[Key, tuple[int, Rearrange | None, Share | None]]) -> None:
        super().__init__()
        self.seeds = seeds

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # nn.init's fills pass their tensor by keyword when they hand themselves to a mode
        target = args[0] if args else kwargs.get("tensor")
        if getattr(func, "__name__", None) not in RANDOM_FILLS or not isinstance(target, torch.Tensor):
            return func(*args, **kwargs)
        key = _key(target)
        if key is None or key not in self.seeds:
            return func(*args, **kwargs)
        local = target.to_local() if isinstance(target, DTensor) else target
        seed, rearrange, share = self.seeds[key]
        shape = share.whole_shape(target.shape) if share is not None else target.shape
        whole = torch.empty(shape, dtype=target.dtype, device=local.device)
        with torch.no_grad(), _seeded(local.device, seed):
            if args:
                func(whole, *args[1:], **kwargs)
            else:
                func(**{**kwargs, "tensor": whole})
            if rearrange is not None:
                rearrange(whole)
            if isinstance(target, DTensor):  # cut locally: every rank drew the same whole tensor
                whole = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local()
            local.copy_(share.cut(whole) if share is not None else whole)
        return target


@contextlib.contextmanager
def seeded_parameters(model: nn.Module, names: dict[str, str], seed: int) -> Iterator[None]:
    """Inside, each random fill of a parameter of `model` draws the parameter's whole tensor from
    `named_seed(seed, its whole-model name in names)` and keeps this rank's share of it."""
    seeds: dict[Key, tuple[int, Rearrange | None, Share | None]] = {}
    for path, module in model.named_modules():
        rearranged: dict[str, Rearrange] = getattr(module, "whole_to_split", {})
        for attr, p in module.named_parameters(recurse=False):
            key, name = _key(p), f"{path}.{attr}" if path else attr
            if key is not None and key not in seeds:  # a tied weight by its first name, as named_parameters
                seeds[key] = (named_seed(seed, names.get(name, name)), rearranged.get(attr), split_share(module, attr))
    with _WholeFills(seeds):
        yield
