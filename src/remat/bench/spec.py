"""BenchSpec: what `remat bench` and `remat sweep` run (the step's settings, steps, the GPU), and its checks."""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from remat.config.fields import optional, parse_bool, parse_int, parse_str, setting
from remat.core.problems import ConfigError, Problem, count, did_you_mean, one_of
from remat.models import parameter_count
from remat.parallel import launched_world
from remat.run.spec import RunSpec, device_problems, run_problems

GPUS: tuple[str, ...] = ("h100", "h200", "b200", "b300", "gb200", "gb300", "vr200", "r100")
# Above this a CPU step takes minutes and tens of GiB: such shapes are for a GPU.
CPU_MAX_PARAMETERS = 300_000_000
DEFAULT_MAX_STEPS = 10
DEFAULT_WARMUP_STEPS = 3
# A benchmark's steps: a million is days of a full-size model, and far more than a median needs.
MAX_STEPS = 1_000_000


@dataclass(frozen=True)
class BenchSpec(RunSpec):
    """A benchmark: `max_steps` training steps of the spec, timed after `warmup_steps`. Validated on creation."""

    max_steps: int = setting(DEFAULT_MAX_STEPS, parse=parse_int, flag=True, short="-ms", metavar="N")
    warmup_steps: int = setting(DEFAULT_WARMUP_STEPS, parse=parse_int, flag=True, metavar="N")
    gpu: str | None = setting(
        None,
        parse=optional(parse_str),
        flag=True,
        short="-g",
        help="GPU label, checked against the device (h100, h200, b200, ...)",
    )
    command: str = field(default_factory=lambda: shlex.join(sys.argv))  # recorded with results
    # only built on meta and printed: a full-size recipe is fine on a CPU
    dryrun: bool = setting(
        False, parse=parse_bool, flag=True, short="-d", help="build, validate and print; run nothing"
    )

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        if self.gpu is not None and self.gpu not in GPUS:
            yield Problem(
                "gpu", f"{self.gpu!r} is not a GPU name{did_you_mean(self.gpu, GPUS)}; use one of {one_of(GPUS)}"
            )
        if self.warmup_steps < 0:
            yield Problem("warmup_steps", f"is {self.warmup_steps}; use --warmup_steps 0 or more")
        elif self.max_steps > MAX_STEPS:
            yield Problem("max_steps", f"is {self.max_steps:,}; a benchmark runs at most {MAX_STEPS:,} steps")
        elif self.max_steps <= self.warmup_steps:
            verb = "leaves" if self.max_steps == 1 else "leave"
            yield Problem(
                "max_steps",
                f"{count(self.max_steps, 'step')} {verb} no steady step after"
                f" {self.warmup_steps} warm-up steps; use -ms {self.warmup_steps + 1} or more",
            )
        if self.compile and self.warmup_steps == 0:
            yield Problem(
                "warmup_steps",
                "is 0 with --compile: the first step compiles and would be timed as a"
                " steady step; use --warmup_steps 1 or more",
            )
        yield from self._launch_problems()
        if not device_problems(self.device):
            yield from self._device_checks()

    def _launch_problems(self) -> Iterator[Problem]:
        """Several GPUs: data parallel (FSDP2) over the processes torchrun started, one per GPU."""
        gpus, started = self.layout.gpus, launched_world()
        yield from run_problems(self)
        if started > 1 and started != gpus:  # outside torchrun, `remat bench -ng N` starts it
            yield Problem(
                "num_gpus",
                f"is {gpus} but torchrun started {count(started, 'process', 'processes')};"
                f" launch with torchrun --nproc-per-node {gpus}, or let remat bench -ng"
                f" {gpus} start it",
            )

    def _device_problems(self) -> Iterator[Problem]:
        yield from device_problems(self.device)

    def _device_checks(self) -> Iterator[Problem]:
        """What the device (already checked to exist) says of this run."""
        if self.device == "cpu" and not self.dryrun:
            try:
                parameters = parameter_count(self.recipe, **self.overrides)
            except (ConfigError, ValueError):  # a bad shape: RunSpec reports it
                parameters = 0
            if parameters > CPU_MAX_PARAMETERS:
                yield Problem(
                    "device",
                    f"{parameters / 1e9:.2f}B parameters is a GPU job; on CPU use a tiny"
                    " recipe or shrink it (--num_layers, --hidden_size), or predict its"
                    " memory without a GPU with `remat estimate`",
                )
        if self.device == "cpu" and self.gpu is not None:
            yield Problem("gpu", f"-g {self.gpu} names a GPU but this run is on CPU; drop -g or run on a GPU")
        elif self.gpu in GPUS and self.device.startswith("cuda"):
            present = torch.cuda.get_device_name(self.device)
            # whole words of the name: "b200" is not a GB200
            if self.gpu not in re.findall(r"[a-z0-9]+", present.lower()):
                yield Problem("gpu", f"-g {self.gpu} but this machine's GPU is {present}; fix -g or drop it")
