"""Capture and restore the state a recompute must replay exactly: RNG streams, autocast and
torch-function modes (autograd runs backward, hence the replay, without them).

Besides torch's default generators, a region captures every registered `RNGStream`: a stream
that code outside the engine swaps into a default generator around the ops that draw from it
(a tensor-parallel rank's own dropout stream, as Megatron's RNG tracker forks one), so that a
replay draws from it exactly what the forward drew.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack


def _cuda_devices(tensors: Iterable[torch.Tensor]) -> list[int]:
    devices = sorted({t.device.index for t in tensors if t.is_cuda})
    if not devices and torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = [torch.cuda.current_device()]  # a region with no CUDA input may still draw CUDA randoms
    return devices


class RNGStream(Protocol):
    """A random stream kept beside torch's default generators; its state is a tensor that is
    replaced, never changed in place."""

    def get_state(self) -> torch.Tensor: ...

    def set_state(self, state: torch.Tensor) -> None: ...


_streams: dict[str, RNGStream] = {}


def register_stream(name: str, stream: RNGStream) -> None:
    """Capture `stream` with every call a region runs from now on and restore it for the replay,
    as the default generators are; a later stream registered under `name` replaces it."""
    _streams[name] = stream


@dataclass(frozen=True)
class ReplayState:
    """CPU and CUDA generator states, autocast settings, torch-function modes and registered
    streams' states in force when a call ran."""

    cpu_rng: torch.Tensor
    cuda_rng: tuple[tuple[int, torch.Tensor], ...]
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    function_modes: tuple[TorchFunctionMode, ...] = ()
    streams: tuple[tuple[RNGStream, torch.Tensor], ...] = ()

    @classmethod
    def capture(cls, tensors: Iterable[torch.Tensor]) -> ReplayState:
        devices = _cuda_devices(tensors)
        cuda_rng = tuple((d, torch.cuda.get_rng_state(d)) for d in devices)
        kinds = ("cpu", "cuda") if devices else ("cpu",)
        autocast = tuple((k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds)
        return cls(
            torch.get_rng_state(),
            cuda_rng,
            autocast,
            tuple(_get_current_function_mode_stack()),
            tuple((stream, stream.get_state()) for stream in _streams.values()),
        )

    @property
    def devices(self) -> list[int]:
        return [d for d, _ in self.cuda_rng]

    def restore_rng(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        for device, state in self.cuda_rng:
            torch.cuda.set_rng_state(state, device)
        for stream, state in self.streams:
            stream.set_state(state)

    @contextlib.contextmanager
    def replay_context(self) -> Iterator[None]:
        """Autocast and function modes as the forward had them."""
        with contextlib.ExitStack() as stack:
            for kind, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            for mode in self.function_modes:
                stack.enter_context(mode)
            yield


@contextlib.contextmanager
def forked_rng(devices: list[int], streams: Iterable[RNGStream] = ()) -> Iterator[None]:
    """Run a replay without disturbing the RNG streams of the surrounding backward pass: the
    default generators (CPU and `devices`) and `streams`."""
    kept = [(stream, stream.get_state()) for stream in streams]
    with torch.random.fork_rng(devices=devices, enabled=True):
        try:
            yield
        finally:
            for stream, state in kept:
                stream.set_state(state)
