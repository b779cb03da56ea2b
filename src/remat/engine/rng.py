"""Capture and restore the state a recompute must replay exactly: RNG streams, autocast and
torch-function modes (autograd runs backward, hence the replay, without them)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack


def _cuda_devices(tensors: Iterable[torch.Tensor]) -> list[int]:
    devices = sorted({t.device.index for t in tensors if t.is_cuda})
    if not devices and torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = [torch.cuda.current_device()]  # a region with no CUDA input may still draw CUDA randoms
    return devices


@dataclass(frozen=True)
class ReplayState:
    """CPU and CUDA generator states, autocast settings and torch-function modes in force when a
    call ran."""

    cpu_rng: torch.Tensor
    cuda_rng: tuple[tuple[int, torch.Tensor], ...]
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    function_modes: tuple[TorchFunctionMode, ...] = ()

    @classmethod
    def capture(cls, tensors: Iterable[torch.Tensor]) -> "ReplayState":
        devices = _cuda_devices(tensors)
        cuda_rng = tuple((d, torch.cuda.get_rng_state(d)) for d in devices)
        kinds = ("cpu", "cuda") if devices else ("cpu",)
        autocast = tuple(
            (k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds
        )
        return cls(torch.get_rng_state(), cuda_rng, autocast, tuple(_get_current_function_mode_stack()))

    @property
    def devices(self) -> list[int]:
        return [d for d, _ in self.cuda_rng]

    def restore_rng(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        for device, state in self.cuda_rng:
            torch.cuda.set_rng_state(state, device)

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
def forked_rng(devices: list[int]) -> Iterator[None]:
    """Run a replay without disturbing the RNG streams of the surrounding backward pass."""
    with torch.random.fork_rng(devices=devices, enabled=True):
        yield
