"""EstimateSpec: one rank of a training run described by shapes, with the target whose kernels,
workspaces and speed an estimate assumes."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from remat.config.fields import optional, parse_float, parse_int, parse_str, setting
from remat.core.problems import ConfigError, Problem, one_of
from remat.core.sizes import parse_bytes
from remat.memory.measure import DEFAULT_HOST_GBPS
from remat.models import Target
from remat.run.spec import RunSpec

ESTIMATE_TARGETS: tuple[str, ...] = ("cuda", "cpu")
# Sustained bf16 dense throughput assumed for estimated step times, about what remat's plans reach
# on an H200 (benchmarks/README.md).
DEFAULT_TFLOPS = 600.0
# cuBLAS keeps a workspace per handle, allocated through torch's caching allocator and held for the
# process's life; torch makes a handle per thread that runs GEMMs: the forward's and autograd's CUDA
# backward thread. Each took 32 MiB on an H200 with torch 2.11 (benchmarks/investigations/README.md).
DEFAULT_CUBLAS_WORKSPACE = 32 * 2**20
CUBLAS_HANDLES = 2


def cublas_workspace_bytes(config: str | None) -> int:
    """One cuBLAS handle's workspace for a CUBLAS_WORKSPACE_CONFIG value (':SIZE:COUNT' pairs, SIZE in
    KiB, summed), or the default where it is unset."""
    if config is None:
        return DEFAULT_CUBLAS_WORKSPACE
    if not re.fullmatch(r"(:\d+:\d+)+", config.strip()):
        raise ConfigError(
            [
                Problem(
                    "CUBLAS_WORKSPACE_CONFIG",
                    f"cannot read {config!r}; cuBLAS takes ':SIZE:COUNT'"
                    " pairs with SIZE in KiB, like ':4096:8' (32 MiB): fix"
                    " or unset it, or give the size as cublas_workspace"
                    " (--cublas_workspace)",
                )
            ]
        )
    numbers = [int(n) for n in config.strip().split(":")[1:]]
    return sum(size * 1024 * count for size, count in zip(numbers[::2], numbers[1::2]))


def estimate_problems(
    target: str, tflops: float, host_gbps: float = DEFAULT_HOST_GBPS, cublas_workspace: int | None = None
) -> Iterator[Problem]:
    """The settings of a shapes-only estimate (`remat estimate`) beyond the step's."""
    if not tflops > 0:
        yield Problem("tflops", f"is {tflops}; give the sustained TFLOP/s one GPU reaches, e.g. 600")
    if not host_gbps > 0:
        yield Problem(
            "host_gbps", f"is {host_gbps}; give the host link's bandwidth each way in GB/s, e.g. {DEFAULT_HOST_GBPS:g}"
        )
    if cublas_workspace is not None and cublas_workspace < 0:
        yield Problem(
            "cublas_workspace", f"is {cublas_workspace} bytes; give 0 or more (one cuBLAS handle's workspace)"
        )
    if cublas_workspace is not None and target != "cuda":
        yield Problem("cublas_workspace", f"counts only on the cuda target, not {target!r}; drop it")


def estimate_threshold_problems(thresholds: Iterable[int]) -> Iterator[Problem]:
    """One estimate traces offload at one min_offloaded_tensor_size."""
    if len(distinct := sorted(set(thresholds))) > 1:
        yield Problem(
            "min_offloaded_tensor_size",
            f"the offload plans use thresholds {distinct}; one estimate traces one: give them the same",
        )


@dataclass(frozen=True)
class EstimateSpec(RunSpec):
    """One rank of a training run, described by shapes: the step's settings with its parallel
    layout, and the target whose kernels and speed to assume."""

    # the target: whose fused kernels (attention, RMSNorm) and workspaces to count
    device: str = setting(
        "cuda",
        parse=parse_str,
        public="target",
        flag=True,
        choices=ESTIMATE_TARGETS,
        help="whose fused kernels (attention, RMSNorm) to count (default cuda)",
    )
    tflops: float = setting(
        DEFAULT_TFLOPS,
        parse=parse_float,
        flag=True,
        metavar="X",
        help=f"sustained TFLOP/s per GPU that times a step (default {DEFAULT_TFLOPS:g})",
    )
    host_gbps: float = setting(
        DEFAULT_HOST_GBPS,
        parse=parse_float,
        flag=True,
        metavar="X",
        help=f"host link bandwidth each way in GB/s that times offload copies (default"
        f" {DEFAULT_HOST_GBPS:g}, pinned copies on an H200)",
    )
    # bytes of one cuBLAS handle's workspace; None: from CUBLAS_WORKSPACE_CONFIG, else torch's default
    cublas_workspace: int | None = setting(
        None,
        parse=optional(parse_int),
        flag=True,
        metavar="SIZE",
        text=lambda size: parse_bytes(size, "cublas_workspace", "b", True),
        help="one cuBLAS handle's workspace on the cuda target, e.g. 8MiB (a bare number is bytes; default: from"
        " CUBLAS_WORKSPACE_CONFIG, else 32 MiB, torch's on an H200; about 8 MiB on GPUs before Hopper);"
        " counted once per GEMM thread",
    )
    # what cuBLAS holds on the target through the step (no tensor's, so no trace sees it); set once
    # from the above, so later changes to the environment do not move an estimate
    workspace_bytes: int = field(init=False, default=0)

    @classmethod
    def of_run(cls, spec: RunSpec, **settings: Any) -> EstimateSpec:
        """The shapes of a run of `spec`, on its kind of device."""
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(RunSpec) if f.name != "device"}
        # a run's data parallelism is FSDP2's
        # (under the distributed optimizer, sharded as Megatron's: counted as such)
        main = spec.optimizer_precision
        fields["optimizer_precision"] = dataclasses.replace(
            main, use_torch_fsdp2=spec.fully_sharded and not main.use_distributed_optimizer
        )
        return cls(**fields, device="cuda" if spec.device.startswith("cuda") else "cpu", **settings)

    @property
    def fully_sharded(self) -> bool:
        """FSDP2 only where asked for (--use_torch_fsdp2); Megatron's data parallelism otherwise."""
        return self.optimizer_precision.use_torch_fsdp2 and super().fully_sharded

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        yield from estimate_problems(self.device, self.tflops, self.host_gbps, self.cublas_workspace)
        try:
            object.__setattr__(self, "workspace_bytes", self._workspace_bytes())  # frozen: set once here
        except ConfigError as err:
            yield from err.problems

    def _device_problems(self) -> Iterator[Problem]:
        if self.device not in ESTIMATE_TARGETS:
            yield Problem("target", f"{self.device!r} is not a target; use one of {one_of(ESTIMATE_TARGETS)}")

    @property
    def target(self) -> Target:
        return "cuda" if self.device.startswith("cuda") else "cpu"

    def _workspace_bytes(self) -> int:
        if self.target != "cuda":
            return 0
        per_handle = (
            cublas_workspace_bytes(os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
            if self.cublas_workspace is None
            else self.cublas_workspace
        )
        return CUBLAS_HANDLES * per_handle
