"""Run real training steps of a recipe under a recompute plan and measure them.

A step is Megatron's iteration: global_batch_size / micro_batch_size micro-batches of forward and
backward (gradients accumulate), then an AdamW step. Timings are CUDA-event medians over the
steps after warm-up; memory peaks are taken over those steps, once the optimizer state exists.
"""
from __future__ import annotations

import datetime
import gc
import shlex
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from remat.apply import apply, offloader_of, warn_if_nothing_offloaded
from remat.bench.flops import model_flops
from remat.bench.result import BenchResult, MemoryBreakdown, OomInfo
from remat.config import MIN_OFFLOADED_TENSOR_SIZE, BenchSettings, ConfigError, Problem, check_bench
from remat.memory import peak_during
from remat.memory.meter import held_tensors, storage_bytes
from remat.memory.trace import Trace, gradients_persist, trace
from remat.models import LlamaConfig, LlamaModel, build
from remat.plans import Plan, PlanLike

_DTYPES = {"bf16": torch.bfloat16}


@dataclass
class BenchSpec:
    """What to run: a recipe with overrides, batch sizes, steps, device. Validated on creation."""

    recipe: str = "llama3_tiny"
    overrides: dict[str, Any] = field(default_factory=dict)  # Megatron model keys
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # None: one micro-batch per step
    max_steps: int = 10
    warmup_steps: int = 3
    task: str = "pretrain"  # "sft" masks the first quarter of each sequence's labels (the prompt)
    compute_dtype: str = "bf16"
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    compile: bool = False  # LlamaModel.compile_regions(): the code between Sites compiled, Triton kernels on CUDA
    seed: int = 1234
    gpu: str | None = None  # Bridge's -g label, checked against the device
    num_gpus: int = 1
    # False: forward+backward only, gradients accumulating across steps, as the anchor measures
    optimizer: bool = True
    command: str = field(default_factory=lambda: shlex.join(sys.argv))  # recorded with results
    dryrun: bool = False  # only built on meta and printed: a full-size recipe is fine on a CPU

    def __post_init__(self) -> None:
        problems: list[Problem] = []
        try:
            model = build(self.recipe, device="meta", **self.overrides)
            parameters = None if self.dryrun else model.num_parameters()
        except ConfigError as err:  # the run settings are checked all the same, and reported together
            problems, parameters = err.problems, None
        try:
            check_bench(BenchSettings(
                self.compute_dtype, self.device, self.micro_batch_size, self.global_batch_size,
                self.max_steps, self.warmup_steps, self.task, parameters, self.gpu, self.num_gpus, self.compile))
        except ConfigError as err:
            problems += err.problems
        if problems:
            raise ConfigError(problems)

    @property
    def micro_batches(self) -> int:
        return (self.global_batch_size or self.micro_batch_size) // self.micro_batch_size


def plan_name(plan: PlanLike) -> str:
    """A short label: none, mlp, core_attn+layernorm, full_uniform_1, plan."""
    if plan is None:
        return "none"
    if isinstance(plan, Plan):
        return "plan"
    if plan.recompute_granularity == "selective":
        name = "+".join(plan.recompute_modules or [])
    elif plan.recompute_granularity == "full":
        name = f"full_{plan.recompute_method}_{plan.recompute_num_layers}"
    else:
        name = "none"
    if plan.cpu_offloading:
        return f"{name}+offload_{plan.cpu_offloading_num_layers}"
    if plan.fine_grained_activation_offloading:
        return f"{name}+offload_{'+'.join(plan.offload_modules)}"
    return name


def _plan_record(plan: PlanLike) -> dict[str, Any]:
    if plan is None:
        return {}
    return plan.to_dict() if isinstance(plan, Plan) else plan.to_megatron()


def build_model(spec: BenchSpec) -> LlamaModel:
    torch.manual_seed(spec.seed)
    model = build(spec.recipe, dtype=_DTYPES[spec.compute_dtype], device=spec.device, **spec.overrides)
    if spec.compile:
        model.compile_regions()
    return model


class MockData:
    """Random tokens, a fresh batch per micro-batch, generated on the device (no host copies)."""

    def __init__(self, spec: BenchSpec, vocab_size: int, seq_length: int) -> None:
        self.spec, self.vocab, self.seq = spec, vocab_size, seq_length
        self.generator = torch.Generator(device=spec.device).manual_seed(spec.seed)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, self.vocab, (self.spec.micro_batch_size, self.seq + 1),
                               device=self.spec.device, generator=self.generator)
        labels = tokens[:, 1:].clone()
        if self.spec.task == "sft":
            labels[:, : self.seq // 4] = -100
        return tokens[:, :-1], labels


class _Clock:
    """CUDA events on GPU (no sync inside a step); wall clock on CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


@dataclass
class _Steps:
    step: list[float] = field(default_factory=list)
    fwd_bwd: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    cpu_peak: int | None = None  # counted tensor bytes, where there is no CUDA allocator
    host_peak: int | None = None  # offloaded bytes held on the host at once, over the steady steps


def _step(model: nn.Module, spec: BenchSpec, data: MockData, optimizer: torch.optim.Optimizer | None,
          clock: _Clock) -> tuple[torch.Tensor, Any, Any, Any]:
    """One iteration: every micro-batch's forward and backward, then the optimizer. Returns the
    loss (on the device, unsynchronized) and the clock marks at start, after backward, at end."""
    start = clock.mark()
    total = torch.zeros((), device=spec.device)
    for _ in range(spec.micro_batches):
        loss = model(*data.batch()) / spec.micro_batches
        loss.backward()
        total += loss.detach()
    mid = clock.mark()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return total, start, mid, clock.mark()


def adamw(params: Iterable[nn.Parameter], fused: bool) -> torch.optim.AdamW:
    """AdamW as Megatron's recipes set it: fused on GPU (moments updated in place, no
    temporaries); elsewhere torch's loop over the tensors, which allocates a few per tensor."""
    return torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)


def make_optimizer(model: nn.Module, spec: BenchSpec) -> torch.optim.Optimizer | None:
    """The bench's AdamW, or None for forward+backward runs."""
    return adamw(model.parameters(), fused=spec.device.startswith("cuda")) if spec.optimizer else None


def _train(model: LlamaModel, spec: BenchSpec,
           on_step: Callable[[int, float], None]) -> tuple[_Steps, torch.optim.Optimizer | None]:
    data = MockData(spec, model.config.vocab_size, model.config.seq_length)
    optimizer = make_optimizer(model, spec)
    clock, steps = _Clock(spec.device), _Steps()
    cuda = spec.device.startswith("cuda")
    offloader = offloader_of(model)
    for step in range(spec.max_steps):
        if step == spec.warmup_steps and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if step == spec.warmup_steps and offloader is not None:
            offloader.reset_stats()
        wall0 = time.perf_counter()
        total, start, mid, end = _step(model, spec, data, optimizer, clock)
        steps.losses.append(total.item())  # the one host sync of a step
        steps.wall.append(time.perf_counter() - wall0)
        steps.step.append(clock.seconds(start, end))
        steps.fwd_bwd.append(clock.seconds(start, mid))
        on_step(step, steps.losses[-1])
    if not cuda:  # no allocator statistics: one more step with every tensor counted
        static = storage_bytes(held_tensors(model, optimizer))
        steps.cpu_peak = static + peak_during(lambda: _step(model, spec, data, optimizer, clock))[1]
    if offloader is not None:
        steps.host_peak = offloader.stats().peak_host_bytes
    return steps, optimizer


def _tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    # moments (exp_avg, exp_avg_sq); the per-parameter step counters are scalars
    states = optimizer.state.values() if optimizer is not None else []
    return _tensor_bytes(v for s in states for k, v in s.items()
                         if isinstance(v, torch.Tensor) and k != "step")


def _breakdown(model: nn.Module, optimizer: torch.optim.Optimizer | None, spec: BenchSpec,
               peak: int) -> MemoryBreakdown:
    weights = _tensor_bytes(model.parameters())
    grads = _tensor_bytes(p for p in model.parameters() if p.requires_grad)
    optim = optimizer_state_bytes(optimizer)
    # Gradients built during backward are part of what the rest of the peak holds.
    persist = gradients_persist(optimizer, spec.micro_batches)
    activations = max(peak - weights - optim - (grads if persist else 0), 0)
    return MemoryBreakdown(weights, grads, optim, activations, grads_persist=persist)


def run_shape(spec: BenchSpec, cfg: LlamaConfig) -> dict[str, Any]:
    """The `shape` a result of this spec records, known before it runs (cfg: the recipe's config)."""
    return dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                ffn_hidden_size=cfg.ffn_hidden_size, seq_length=cfg.seq_length,
                vocab_size=cfg.vocab_size, micro_batch_size=spec.micro_batch_size,
                global_batch_size=spec.global_batch_size or spec.micro_batch_size,
                max_steps=spec.max_steps, task=spec.task, compute_dtype=spec.compute_dtype, compile=spec.compile,
                gradient_accumulation_fusion=cfg.gradient_accumulation_fusion)


def _base_record(spec: BenchSpec, model: LlamaModel, plan: PlanLike, name: str | None) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name() if spec.device.startswith("cuda") else "cpu"
    return dict(
        name=name or plan_name(plan), recipe=spec.recipe, config=_plan_record(plan),
        shape=run_shape(spec, model.config),
        device=spec.device.split(":")[0], gpu=gpu, torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=spec.command,
    )


def run_bench(spec: BenchSpec, plan: PlanLike = None, *, model: LlamaModel | None = None,
              name: str | None = None, progress: Progress | None = None,
              on_oom: Callable[[torch.cuda.OutOfMemoryError], Any] | None = None) -> BenchResult:
    """Train `spec.max_steps` steps under `plan` and measure them. An out-of-memory error is a
    result (status "oom"), after which the memory it held is released; `on_oom` sees the error
    first, while the failed step's tensors are alive (remat doctor's `Doctor.observe`)."""
    model = model or build_model(spec)
    torch.manual_seed(spec.seed)
    model.init_weights()  # every run of a sweep starts from the same weights
    model.train()
    apply(model, plan)
    record = _base_record(spec, model, plan, name)
    task = progress.add_task(record["name"], total=spec.max_steps, loss="") if progress else None

    def on_step(step: int, loss: float) -> None:
        if progress is not None and task is not None:
            progress.update(task, advance=1, loss=f"loss {loss:.4f}")

    cuda = spec.device.startswith("cuda")
    oom: OomInfo | None = None
    try:
        steps, optimizer = _train(model, spec, on_step)
    except torch.cuda.OutOfMemoryError as e:
        # measured while the failed step's tensors are still referenced by the traceback
        oom = OomInfo(torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), str(e).split("\n")[0])
        if on_oom is not None:
            on_oom(e)
    if oom is not None:
        release_memory(model)  # outside the except block, so the traceback's frames are gone
        if progress is not None and task is not None:
            progress.update(task, loss="[red]OOM[/]")
        return BenchResult(status="oom", oom=oom, **record)
    warn_if_nothing_offloaded(model)
    steady = slice(spec.warmup_steps, None)
    step_s, fwd_bwd_s = statistics.median(steps.step[steady]), statistics.median(steps.fwd_bwd[steady])
    flops = model_flops(model.config, model.config.seq_length,
                        spec.micro_batch_size * spec.micro_batches)
    peak = torch.cuda.max_memory_allocated() if cuda else steps.cpu_peak
    assert peak is not None  # _train counts it where there is no CUDA allocator
    result = BenchResult(
        status="ok", step_time_s=step_s, fwd_bwd_time_s=fwd_bwd_s,
        tflops_per_gpu=flops / step_s / 1e12, tflops_fwd_bwd=flops / fwd_bwd_s / 1e12,
        tokens_per_s_per_gpu=spec.micro_batch_size * spec.micro_batches * model.config.seq_length / step_s,
        peak_allocated_bytes=peak,
        peak_reserved_bytes=torch.cuda.max_memory_reserved() if cuda else None,
        peak_host_bytes=steps.host_peak,
        memory=_breakdown(model, optimizer, spec, peak), losses=steps.losses,
        harness_overhead=max(0.0, 1 - sum(steps.step[steady]) / sum(steps.wall[steady])),
        **record,
    )
    del optimizer
    release_memory(model)
    return result


def trace_spec(spec: BenchSpec, model: LlamaModel | None = None, offload: bool = False,
               min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE,
               progress: Callable[[str], None] | None = None) -> tuple[LlamaModel, Trace]:
    """Trace the step `run_bench` would run: same model, batch shape, optimizer, micro-batches
    (and, with `offload`, offload actions with that threshold)."""
    model = model or build_model(spec)
    torch.manual_seed(spec.seed)
    model.init_weights()
    model.train()
    batch = MockData(spec, model.config.vocab_size, model.config.seq_length).batch()
    optimizer = make_optimizer(model, spec)
    measured = trace(model, batch, optimizer=optimizer, micro_batches=spec.micro_batches, offload=offload,
                     min_offloaded_tensor_size=min_offloaded_tensor_size, progress=progress)
    del optimizer, batch
    release_memory(model)
    return model, measured


def release_memory(model: nn.Module) -> None:
    """Drop gradients and cached blocks so the next run starts from the weights alone."""
    for p in model.parameters():
        p.grad = None
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def progress_bar(enabled: bool = True) -> Progress | nullcontext:
    if not enabled:
        return nullcontext()
    return Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[loss]}"), TimeElapsedColumn())


def sweep(spec: BenchSpec, plans: Sequence[tuple[str, PlanLike]], *, progress: bool = True) -> list[BenchResult]:
    """Run every (name, plan) on one model in one process; OOMs are results, the rest go on."""
    model = build_model(spec)
    results = []
    with progress_bar(progress) as bar:
        for name, plan in plans:
            results.append(run_bench(spec, plan, model=model, name=name,
                                     progress=bar))
    return results
