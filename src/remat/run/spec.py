"""RunSpec: the step to run, spelled once for every measurement (`remat bench` times it,
`remat.trace` and `remat plan` measure it, `remat estimate` runs it on shapes): a recipe with
overrides, the batch, the parallel layout, the precision, CUDA graphs and the optimizer.

A step is Megatron's iteration: global_batch_size / (micro_batch_size x data parallel)
micro-batches of forward and backward (gradients accumulate), then an AdamW step.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat import models
from remat.config.capture import Capture
from remat.config.fields import from_public, optional, parse_bool, parse_float, parse_int, parse_str, setting
from remat.config.megatron import TrainingFacts
from remat.config.parallel import ParallelLayout
from remat.config.precision import Precision
from remat.core.problems import ConfigError, Problem, did_you_mean, one_of, raise_if_any
from remat.models import ModelConfig, ModelFamily
from remat.run.fp8 import fp8_run_problems
from remat.run.optimizer import DTYPES, OptimizerPrecision

TASKS: tuple[str, ...] = ("pretrain", "sft")
BRIDGE_TASKS: tuple[str, ...] = ("pretrain", "sft", "peft")
# Tokens of one micro-batch on one GPU: 2^22 of a 4096-wide bf16 hidden state are 32 GiB a layer,
# past what a GPU trains; the shapes-only trace of far more loops for hours.
MAX_TOKENS_PER_GPU = 1 << 22
# Micro-batches a step accumulates on one rank: far past what Megatron runs (thousands at most).
MAX_MICRO_BATCHES = 1 << 16


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _layer_frequency(text: str) -> int | str:
    return int(text) if text.isdigit() else text


@dataclass(frozen=True)
class ModelOverrides:
    """A recipe's fields a command line replaces (Megatron's names); None: the recipe's."""

    num_layers: int | None = setting(None, parse=optional(parse_int), flag=True, metavar="N")
    hidden_size: int | None = setting(None, parse=optional(parse_int), flag=True, metavar="N")
    seq_length: int | None = setting(None, parse=optional(parse_int), flag=True, short="-sl", metavar="N")
    num_moe_experts: int | None = setting(
        None, parse=optional(parse_int), flag=True, metavar="N", help="MoE recipes: routed experts (a slice that fits)"
    )
    moe_layer_freq: int | str | None = setting(
        None,
        parse=optional(parse_str),
        flag=True,
        metavar="F",
        text=_layer_frequency,
        help="MoE recipes: every F-th layer is MoE, or one 0/1 per layer as '[0]*1+[1]*3'",
    )
    gradient_accumulation_fusion: bool | None = setting(
        None,
        parse=optional(parse_bool),
        flag="--no_gradient_accumulation_fusion",
        help="let autograd add each weight gradient into .grad with its own kernel instead of the weight-gradient"
        " GEMM (Megatron's --no-gradient-accumulation-fusion)",
    )
    attention_backend: str | None = setting(None, parse=optional(parse_str), flag=True, choices=("sdpa", "eager"))
    attention_dropout: float | None = setting(None, parse=optional(parse_float), flag=True, metavar="P")
    hidden_dropout: float | None = setting(None, parse=optional(parse_float), flag=True, metavar="P")


@dataclass(frozen=True)
class RunSpec:
    """The step to run: a recipe with overrides (Megatron's model keys), batch, layout, precision,
    capture and kernels. Validated on creation: every problem at once."""

    recipe: str = setting(
        "llama3_tiny",
        parse=parse_str,
        public="model_recipe_name",
        flag=True,
        short="-mr",
        metavar="RECIPE",
        help="see `remat recipes` (default llama3_tiny, which runs on CPU)",
    )
    overrides: Mapping[str, Any] = field(default_factory=dict)
    micro_batch_size: int = setting(1, parse=parse_int, flag=True, short="-mb", metavar="N")
    # sequences per step over all data-parallel ranks; None: one micro-batch per rank
    global_batch_size: int | None = setting(None, parse=optional(parse_int), flag=True, short="-gb", metavar="N")
    device: str = setting(
        parse=parse_str,
        flag=True,
        default_factory=default_device,
        help="cuda or cpu (default: cuda when there is a GPU)",
    )
    # the model's code between Sites compiled, its fast kernels on the device
    compile: bool = setting(
        False,
        parse=parse_bool,
        flag=True,
        negatable=True,
        help="torch.compile the model's regions between Sites (QKV split+RoPE, SwiGLU, loss"
        " softmax); on CUDA, SwiGLU+linear_fc2, the QKV split with RoPE, RMSNorm and the loss"
        " chunk run remat's Triton kernels; a Hugging Face model gets the chunked loss head."
        " Default: on for CUDA (the fast path), off for CPU",
    )
    optimizer: bool = setting(
        True,
        parse=parse_bool,
        flag="--no_optimizer",
        help="forward+backward only, gradients accumulating, as the torch anchor measures",
    )
    task: str = setting(
        "pretrain",
        parse=parse_str,
        flag=True,
        metavar="TASK",
        help="pretrain or sft (labels of the first quarter masked)",
    )
    seed: int = setting(1234, parse=parse_int, flag=True, metavar="N", help="the seed of the weights and data")
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    precision: Precision = field(default_factory=Precision)
    capture: Capture = field(default_factory=Capture)
    optimizer_precision: OptimizerPrecision = field(default_factory=OptimizerPrecision)

    def __post_init__(self) -> None:
        raise_if_any(self.problems())

    def problems(self) -> Iterator[Problem]:
        """What is wrong with these settings (a subclass adds its own)."""
        config = None
        try:
            config = self.model_config
        except ConfigError as err:
            yield from err.problems
        except ValueError as err:  # an unknown recipe or override
            yield Problem("model_recipe_name", str(err))
        yield from self.precision.problems()
        yield from fp8_run_problems(self.precision, self.device)
        yield from _task_problems(self.task)
        yield from self.optimizer_precision.problems()
        yield from self._device_problems()
        yield from micro_batch_problems(self.micro_batch_size)
        yield from self.layout.problems(config.num_layers if config is not None else None)
        yield from self._global_batch_problems()
        if config is not None:
            yield from micro_batch_tokens_problems(config.seq_length, self.micro_batch_size, self.layout.cp)
            yield from self.family.layout_problems(config, self.layout)

    def _device_problems(self) -> Iterator[Problem]:
        yield from _device_name_problems(self.device)

    def _global_batch_problems(self) -> Iterator[Problem]:
        gpus = self.layout.num_gpus
        if (
            self.global_batch_size is None
            or self.micro_batch_size < 1
            or (gpus is not None and (gpus < 1 or gpus % self.layout.model_parallel))
        ):
            return  # nothing to check, or the sizes' own problems
        per_step = self.micro_batch_size * self.layout.dp
        of = f"the micro-batch size {per_step}" if self.layout.dp == 1 else f"micro-batch x data parallel = {per_step}"
        if self.global_batch_size < per_step or self.global_batch_size % per_step:
            yield Problem(
                "global_batch_size",
                f"{self.global_batch_size} is not a positive multiple of {of}; use a multiple of it",
            )
        elif self.global_batch_size // per_step > MAX_MICRO_BATCHES:
            yield Problem(
                "global_batch_size",
                f"{self.global_batch_size:,} makes {self.global_batch_size // per_step:,}"
                f" micro-batches a step; remat runs at most {MAX_MICRO_BATCHES:,}:"
                " lower -gb or raise -mb",
            )

    def facts(self) -> TrainingFacts:
        """What the recompute rules read of this run: its model's layers, dropout and switches, its
        layout, CUDA graphs and precision."""
        return TrainingFacts(
            layout=self.layout,
            capture=self.capture,
            precision=self.precision,
            **from_public(TrainingFacts, self.model_config.megatron_facts()),
        )

    @property
    def family(self) -> ModelFamily:
        return models.family_of(self.recipe)

    @property
    def model_config(self) -> ModelConfig:
        return models.recipe_config(self.recipe, **self.overrides)

    @property
    def dtype(self) -> torch.dtype:
        return self.precision.dtype

    @property
    def fully_sharded(self) -> bool:
        """Whether FSDP2 shards the training state over the dp x cp ranks: in every run with data
        or context parallelism (remat's data parallelism is FSDP2)."""
        return self.layout.replicas > 1

    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype parameters are kept in: under FSDP2 with main parameters, theirs (FSDP2
        gathers them in the compute dtype); otherwise the compute dtype."""
        main = self.optimizer_precision.main_params_dtype
        return DTYPES[main] if self.fully_sharded and main is not None else self.dtype

    @property
    def micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs a step."""
        per_step = self.micro_batch_size * self.layout.dp
        if self.global_batch_size is None or per_step < 1:  # a size below 1 is its own problem
            return 1
        return max(self.global_batch_size // per_step, 1)


def run_problems(spec: RunSpec) -> Iterator[Problem]:
    """What a run of `spec` needs beyond what an estimate of one of its ranks does: a process for
    each expert-parallel rank, a schedule that runs its micro-batches, and a model that runs its
    layout (its family's plan for the built model), CUDA graphs aside."""
    layout = spec.layout
    yield from layout.schedule_problems(spec.micro_batches)
    if layout.ep > 1 and layout.num_gpus is None:
        yield Problem(
            "num_gpus",
            f"is not given, so this runs one copy of the model on tp x pp x cp ="
            f" {layout.model_parallel} GPU(s); -ep {layout.ep} splits the experts over"
            f" {layout.ep} data-parallel ranks: use -ng {layout.model_parallel * layout.ep}",
        )
    yield from unrun_problems(spec.capture)
    try:
        model = parallel_meta_model(spec.family, spec.model_config, layout)
    except (ConfigError, ValueError):  # the spec's own problems, reported with it
        return
    yield from spec.family.parallelism(model, layout).problems()


def parallel_meta_model(family: ModelFamily, config: Any, layout: ParallelLayout) -> nn.Module:
    """The model of `config` on the meta device with its experts split by the layout's ep: what
    the family's `ModelParallelism` checks before a run."""
    return family.build(family.shard(config, ParallelLayout(ep=layout.ep), range(config.num_layers)), device="meta")


def single_process_problems(layout: ParallelLayout) -> Iterator[Problem]:
    """What the recompute rules accept but a one-process step (verify) does not run."""
    for name, size in (
        ("tensor_model_parallel_size", layout.tp),
        ("pipeline_model_parallel_size", layout.pp),
        ("context_parallel_size", layout.cp),
    ):
        if size != 1:
            yield Problem(
                name,
                f"is {size}; this runs one process, without model parallelism; use 1 (remat bench"
                " runs it under torchrun)",
            )
    if layout.vp is not None:
        yield Problem(
            "virtual_pipeline_model_parallel_size",
            "needs pipeline parallelism, which this run does not execute; drop -vp",
        )


def unrun_problems(capture: Capture) -> Iterator[Problem]:
    """What the recompute rules accept but remat does not run yet (remat estimate predicts it)."""
    if capture.captures:
        yield Problem("cuda_graph_impl", "this runs without CUDA graphs; drop --cuda_graph_impl and --cuda_graph_scope")


def _task_problems(task: str) -> Iterator[Problem]:
    if task not in TASKS:
        yield Problem(
            "task",
            f"{task!r} is "
            + (
                "not supported yet"
                if task in BRIDGE_TASKS
                else f"not a task{did_you_mean(task, TASKS)}; Megatron Bridge's are {one_of(BRIDGE_TASKS)}"
            )
            + f"; use {' or '.join(TASKS)}",
        )


def _device_name_problems(device: str) -> Iterator[Problem]:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        yield Problem("device", f"{device!r} is not a device; use cpu, cuda or cuda:N")


def device_problems(device: str) -> list[Problem]:
    """A device a step runs on: cpu, cuda or cuda:N, and a GPU where one is asked for."""
    problems = list(_device_name_problems(device))
    if not problems and device.startswith("cuda") and not torch.cuda.is_available():
        problems.append(
            Problem(
                "device",
                "a CUDA GPU was asked for but this machine has none; run on CPU with a"
                " tiny recipe (remat recipes lists it)",
            )
        )
    return problems


def micro_batch_problems(micro_batch_size: int) -> Iterator[Problem]:
    if micro_batch_size < 1:
        yield Problem("micro_batch_size", f"is {micro_batch_size}; use at least 1")


def micro_batch_tokens_problems(
    seq_length: int, micro_batch_size: int, context_parallel_size: int
) -> Iterator[Problem]:
    tokens = seq_length * micro_batch_size // max(context_parallel_size, 1)
    if tokens > MAX_TOKENS_PER_GPU:
        yield Problem(
            "seq_length",
            f"{seq_length} x micro-batch {micro_batch_size} over {context_parallel_size}"
            f" context-parallel rank(s) puts {tokens:,} tokens on each GPU; remat"
            f" runs at most {MAX_TOKENS_PER_GPU:,} (2^22: at hidden size 4096 their"
            " hidden states alone are 32 GiB a layer); lower -sl or -mb, or raise -cp",
        )


def available_host_bytes() -> int | None:
    """Memory this process can still allocate on the host: the kernel's MemAvailable, within the
    container's limit where one is set; None where neither can be read."""
    found: list[int] = []
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        found.append(int(meminfo["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
