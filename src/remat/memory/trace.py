"""trace(): measure what every site action saves and costs, per layer; predict any plan's memory.

One instrumented training step per action, on one representative layer of each kind, records
the bytes the forward leaves saved and the peak of every memory window of the step: the forward
and the backward of each layer, the loss head between them, the rest of the backward and the
optimizer step. Layers interact only through the residual stream, so an action changes the
windows of its own layers by what was measured, every later window that still holds its saved
tensors by the bytes it frees, and nothing else. Summing those effects predicts any plan, and
the planner optimizes over the same sums.

A layer's sites do interact (a discarded norm output is also the MLP's input), so the memory of
every combination of actions in a layer is measured, not each site alone; an action at a site
that an enclosing recomputed site replays (`mlp_act` inside `mlp`) does nothing and is dropped.
Recompute cost is the step time added when every layer of the kind runs one action, per layer; a
combination adds the work of each of its actions, one after another, so it costs their sum.

With `offload=True` the trace also measures offloading: each combination with the rest of the
layer offloaded, each site offloaded alone, and recompute groups with their input offloaded.
Offload reaches one layer further than recompute: the copies out may still run during the next
layer's forward, and the copies back start when the next layer's backward begins, so those two
windows are measured as well (on a layer that has a next one).
"""
from __future__ import annotations

import gc
import itertools
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from remat.apply import apply, find_sites, offloader_of
from remat.config import (
    DISCARD_MODULES,
    DISCARD_ONLY,
    ENCLOSING,
    LAYER,
    MIN_OFFLOADED_TENSOR_SIZE,
    ConfigError,
    ModelLayout,
    Problem,
    RecomputeConfig,
    check_model,
    check_plan,
    offload_prediction_problems,
    planning_problems,
)
from remat.memory.attribution import Attributor, Owner, SiteStorages, owner_name
from remat.memory.meter import CpuMeter, CudaMeter, Meter, held_tensors, storage_bytes
from remat.planner import Choice, PlanningProblem, Window
from remat.plans import Plan
from remat.sites import Site

Combo = frozenset[tuple[str, str]]  # (label, action) pairs that differ from keep
Offset = tuple[str, int]  # ("fwd" | "bwd", layer index relative to the first layer of a choice)
OFFLOAD: tuple[str, str] = (LAYER, "offload")  # a combo's pair for "offload what else the layer saves"
MEASURED_GROUP_SIZES = (1, 2, 3)  # full-recompute group sizes measured; longer ones extrapolate


@dataclass(frozen=True)
class Effect:
    """What running one layer one way (or a range of layers as one recompute group) changes
    against keeping everything: bytes freed after the forward, extra peak bytes in the windows of
    its own layers, step time added."""

    freed_bytes: int
    window_bytes: dict[Offset, int]
    added_time_s: float = 0.0
    host_bytes: int = 0  # moved to host memory by offload


@dataclass(frozen=True)
class LayerEffects:
    combos: dict[Combo, Effect]  # one layer's site actions
    groups: dict[int, Effect]  # full recompute of `size` layers ending at this layer's kind
    input_bytes: int  # the layer's input, freed too when the layer sits inside a larger group
    layer_time_s: float  # step time one layer's full recompute adds
    offloaded_groups: dict[int, Effect] = field(default_factory=dict)  # groups whose input goes to host

    def group(self, size: int, offload_input: bool = False) -> Effect:
        """A group of `size` layers; beyond the measured sizes, windows extrapolate: forward
        windows drop by one layer's saved bytes per position, backward ones stay level (and the
        next layer's windows, which an offloaded input reaches, stay as measured)."""
        measured = self.offloaded_groups if offload_input else self.groups
        largest = max(measured)
        if size <= largest:
            return measured[size]
        m = measured[largest]
        fwd_step = (m.window_bytes[("fwd", largest - 1)] - m.window_bytes[("fwd", largest - 2)]
                    if largest > 1 else 0)
        windows: dict[Offset, int] = {}
        for q in range(size):
            source = min(q, max(largest - 2, 0)) if q < size - 1 else largest - 1
            windows[("bwd", q)] = m.window_bytes[("bwd", source)]
            windows[("fwd", q)] = m.window_bytes[("fwd", source)] + (q - source) * fwd_step
        freed = m.freed_bytes + (size - largest) * (self.groups[1].freed_bytes + self.input_bytes)
        # the next layer's windows (offload's reach) hold the group's layers freed: the extra ones too
        windows.update({(phase, size): b - (freed - m.freed_bytes)
                        for (phase, q), b in m.window_bytes.items() if q == largest})
        extra_time = m.added_time_s - largest * self.layer_time_s  # offloading the input, if any
        return Effect(freed, windows, size * self.layer_time_s + extra_time, m.host_bytes)


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted memory and time, without running it."""

    saved_bytes: int  # allocated by the forward and still held when it returns
    peak_bytes: int  # max allocated over the whole step
    step_time_s: float
    peak_window: str  # where the peak falls: "bwd7", "head", "optimizer", ...
    host_bytes: int = 0  # offloaded to host memory (pinned) at the end of the forward


@dataclass(frozen=True)
class Trace:
    layout: ModelLayout
    baseline_saved_bytes: int
    base_step_time_s: float
    windows: tuple[Window, ...]  # peaks of the no-recompute step, in step order
    layers: tuple[LayerEffects, ...]
    max_group: int = 16  # longest full-recompute group the planner considers
    offload: bool = False  # whether offload was measured
    min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE  # the threshold offload was measured with
    # what the micro-batch does not scale: allocated when a steady step starts (weights, optimizer
    # state, the batch, gradients that persist), and the gradients backward creates when they do not
    fixed_bytes: int | None = None
    # what each site of each layer (and the embedding, the loss head) saves in a no-recompute step
    storages: dict[Owner, SiteStorages] = field(default_factory=dict)

    def choice(self, start: int, end: int, actions: dict[str, str] | None,
               offload_input: bool = False) -> Choice:
        """Layers [start, end) run one way: `actions` for one layer, None for a recompute group
        (with `offload_input`, its input goes to host)."""
        if actions is None:
            effect = (self.offloaded_group(start, end) if offload_input
                      else self.layers[end - 1].group(end - start))
        else:
            effect = self._combo_effect(start, _combo(actions))
        windows = {f"{phase}{start + q}": b for (phase, q), b in effect.window_bytes.items()}
        return Choice(start, end, None if actions is None else dict(actions), effect.freed_bytes,
                      effect.added_time_s, windows, effect.host_bytes, offload_input)

    def offloaded_group(self, start: int, end: int) -> Effect:
        effects = self.layers[end - 1]
        if not effects.offloaded_groups:
            raise ConfigError([Problem(f"layers[{start}]", f"the trace measured no offloaded recompute input for "
                                                           f"the kind of layer {end - 1} (no layer of that kind has a"
                                                           f" next one); keep the input of [{start}, {end}) on the GPU")])
        return effects.group(end - start, offload_input=True)

    def _combo_effect(self, layer: int, combo: Combo) -> Effect:
        effects = self.layers[layer].combos
        if combo not in effects:
            raise ConfigError([_unmeasured(layer, combo)])
        return effects[combo]

    def choices(self) -> list[Choice]:
        """Every way to run every layer: each site combination, each recompute group. Offload
        only where a later layer's backward leaves time to copy the tensors back."""
        n = self.layout.num_layers
        out = [self.choice(i, i + 1, dict(combo)) for i in range(n) for combo in self.layers[i].combos
               if i < n - 1 or not _offloads(combo)]
        if self.layout.has_layer_sites:
            out += [self.choice(s, e, None) for s in range(n)
                    for e in range(s + 1, min(n, s + self.max_group) + 1)]
            out += [self.choice(s, e, None, offload_input=True) for s in range(n)
                    for e in range(s + 1, min(n - 1, s + self.max_group) + 1)
                    if self.layers[e - 1].offloaded_groups]
        return out

    def problem(self) -> PlanningProblem:
        """What the planner solves: every choice worth making, over this step's windows. Not
        offered: a choice that frees nothing and lowers no window, and one that acts on a site
        whose action changes no byte beside the layer's other actions (core_attn under a fused
        attention beside mlp recompute): either only costs time."""
        choices = self.choices()
        by_layer: dict[int, list[Choice]] = {}
        for c in choices:
            if c.actions:
                by_layer.setdefault(c.start, []).append(c)
        useful = [c for c in choices if not c.actions or (
            _frees_something(c) and not any(_no_worse_with_fewer_actions(other, c) for other in by_layer[c.start]))]
        return PlanningProblem(self.layout.num_layers, useful, self.windows, self.fixed_bytes)

    def predict(self, plan: RecomputeConfig | Plan | None) -> Prediction:
        resolved = _resolve(plan, self.layout)
        problems = list(offload_prediction_problems(resolved.layers, resolved.full_recompute))
        if problems:
            raise ConfigError(problems)
        if resolved.offloads() and not self.offload:
            raise ConfigError([Problem("offload", "this trace did not measure offload; trace with "
                                                  "offload=True (remat plan --offload) to predict an offload plan")])
        if resolved.offloads() and resolved.min_offloaded_tensor_size != self.min_offloaded_tensor_size:
            raise ConfigError([Problem("min_offloaded_tensor_size", (
                f"the plan offloads storages of {resolved.min_offloaded_tensor_size} elements or more, the trace"
                f" measured {self.min_offloaded_tensor_size}; trace with the plan's threshold"))])
        grouped = {i for s, e in resolved.full_recompute for i in range(s, e)}
        chosen = [self.choice(s, e, None, resolved.layers[s].get(LAYER) == "offload")
                  for s, e in resolved.full_recompute]
        chosen += [self.choice(i, i + 1, a) for i, a in enumerate(resolved.layers) if i not in grouped]
        problem = PlanningProblem(self.layout.num_layers, chosen, self.windows)
        peak, window = problem.peak_and_window(chosen)
        return Prediction(self.baseline_saved_bytes - sum(c.freed_bytes for c in chosen), peak,
                          self.base_step_time_s + sum(c.added_time_s for c in chosen), window,
                          sum(c.host_bytes for c in chosen))


def _frees_something(choice: Choice) -> bool:
    return choice.freed_bytes > 0 or any(b < 0 for b in choice.window_bytes.values())


def _no_worse_with_fewer_actions(fewer: Choice, more: Choice) -> bool:
    """`fewer` keeps some of the sites `more` acts on (and does the same elsewhere), and is no
    worse in any window: `more`'s extra actions would only cost time."""
    extra = _combo(more.actions or {})
    if fewer.actions is None or not _combo(fewer.actions) < extra:
        return False
    windows = set(fewer.window_bytes) | set(more.window_bytes)
    return fewer.freed_bytes >= more.freed_bytes and fewer.host_bytes <= more.host_bytes and all(
        fewer.window_bytes.get(w, 0) <= more.window_bytes.get(w, 0) for w in windows)


def _combo(actions: dict[str, str]) -> Combo:
    """The actions that act: not keep, and not at a site whose enclosing site recomputes (its
    replay runs the inner site plainly)."""
    recomputed = {label for label, action in actions.items() if action == "recompute"}
    return frozenset((label, action) for label, action in actions.items()
                     if action != "keep" and ENCLOSING.get(label) not in recomputed)


def _offloads(combo: Combo) -> bool:
    return any(action == "offload" for _, action in combo)


def _resolve(plan: RecomputeConfig | Plan | None, layout: ModelLayout) -> Plan:
    if plan is None:
        return Plan.none(layout.num_layers)
    if isinstance(plan, RecomputeConfig):
        check_model(plan, layout)
        plan = Plan.from_config(plan, layout)
    else:
        check_plan(plan.layers, plan.full_recompute, layout)
    return plan


def _combos(labels: frozenset[str]) -> list[Combo]:
    """Keep or recompute every label (discard instead where that is all that frees anything);
    discard too where outputs are discarded (layernorm...). Each distinct combination once."""
    ordered = sorted(labels)
    options = [("keep", *(() if label in DISCARD_ONLY else ("recompute",)),
                *(("discard",) if label in DISCARD_MODULES else ())) for label in ordered]
    return list(dict.fromkeys(_combo(dict(zip(ordered, choice))) for choice in itertools.product(*options)))


def unmeasured_problems(plan: Plan, layout: ModelLayout, offload: bool) -> Iterator[Problem]:
    """The layers whose actions a trace (with or without offload) does not measure: known before
    tracing (`estimate` checks every plan first)."""
    grouped = {i for s, e in plan.full_recompute for i in range(s, e)}
    for i, actions in enumerate(plan.layers):
        combo = _combo(actions)
        measured = _combos(layout.labels[i]) + (_offload_combos(layout.labels[i]) if offload else [])
        if i not in grouped and combo not in measured:
            yield _unmeasured(i, combo)


def _unmeasured(layer: int, combo: Combo) -> Problem:
    shown = ", ".join(f"{k}={v}" for k, v in sorted(combo))
    return Problem(f"layers[{layer}]", f"the trace did not measure {shown}" + (
        " (offload in a layer: the trace measures each site offloaded alone, or layer=offload with the other"
        " sites kept, recomputed or discarded)" if _offloads(combo) else ""))


def _offload_combos(labels: frozenset[str]) -> list[Combo]:
    """Offload the heavy, recompute the cheap: every combination with the rest of the layer
    offloaded, and each site offloaded alone (which keeps the copies short)."""
    return ([combo | {OFFLOAD} for combo in _combos(labels)]
            + [frozenset({(label, "offload")}) for label in sorted(labels)])


def _signature(model: nn.Module, site: Site, labels: frozenset[str]) -> tuple[Any, ...]:
    """Layers with equal signatures behave alike: same site labels, same parameter shapes."""
    owner = next(m for m in model.modules() if any(child is site for child in m.children()))
    return labels, tuple((n, tuple(p.shape), p.dtype) for n, p in owner.named_parameters())


# ---- one instrumented step ------------------------------------------------------------------

@dataclass
class _Record:
    held_bytes: int = 0  # allocated when the step starts
    saved_bytes: int = 0
    peaks: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0  # offloaded during the step


class _Windows:
    """Marks the windows of a step with hooks on the layer Sites and on the layers' activations."""

    def __init__(self, meter: Meter, layer_sites: list[Site],
                 on_mark: Callable[[str, int], None] | None = None) -> None:
        self.meter, self.last = meter, len(layer_sites) - 1
        self.on_mark = on_mark
        self.record = _Record()
        self.current = "pre"
        self.backward = False  # once backward runs, forwards are recompute replays: not windows
        self.handles = [h for i, site in enumerate(layer_sites) for h in (
            site.register_forward_pre_hook(lambda m, args, i=i: self._enter(i, args[1])),
            site.register_forward_hook(lambda m, args, out, i=i: self._exit(i, out)))]

    def mark(self, name: str) -> None:
        peak = self.meter.take_peak()
        self.record.peaks[self.current] = max(self.record.peaks.get(self.current, 0), peak)
        self.current = name
        if self.on_mark is not None:
            self.on_mark(name, peak)

    def _on_grad(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.backward = True
            self.mark(name)
        return hook

    def _enter(self, i: int, x: Any) -> None:
        if self.backward:
            return
        self.mark(f"fwd{i}")
        if isinstance(x, torch.Tensor) and x.requires_grad:  # its gradient ends layer i's backward
            x.register_hook(self._on_grad(f"bwd{i - 1}" if i else "tail"))

    def _exit(self, i: int, out: Any) -> None:
        if self.backward or i != self.last:
            return
        self.mark("head")
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._on_grad(f"bwd{i}"))

    def close(self) -> _Record:
        for h in self.handles:
            h.remove()
        return self.record


def gradients_persist(optimizer: torch.optim.Optimizer | None, micro_batches: int) -> bool:
    """Whether gradients exist when a step starts: they accumulate across steps without an
    optimizer, and across micro-batches with several; otherwise the optimizer step frees them and
    backward builds them again."""
    return optimizer is None or micro_batches > 1


@dataclass
class _Stepper:
    """Runs the training step the trace measures, the way `remat bench` runs it: forward,
    backward, then the optimizer step (its learning rate held at 0 so weights do not move)."""

    model: nn.Module
    batch: tuple[torch.Tensor, torch.Tensor]
    optimizer: torch.optim.Optimizer | None
    grads_persist: bool  # gradients_persist(): gradients exist at step start
    seed: int
    flops_per_s: float | None = None  # the rate that times a step on the meta device
    min_offloaded: int = MIN_OFFLOADED_TENSOR_SIZE  # every offload plan runs with this threshold
    host_bytes_per_s: float | None = None  # the host link that times copies on the meta device

    @property
    def cuda(self) -> bool:
        return self.batch[0].device.type == "cuda"

    def step(self, windows: _Windows | None = None, meter: Meter | None = None,
             after_forward: Callable[[], None] | None = None) -> None:
        torch.manual_seed(self.seed)
        before = meter.now() if meter else 0
        out = self.model(*self.batch)
        if after_forward is not None:
            after_forward()
        if windows and meter:
            gc.collect()
            windows.record.held_bytes = before
            windows.record.saved_bytes = meter.now() - before
        # a pipeline stage before the last returns hidden states: the next stage sends their gradient
        out.backward(None if out.dim() == 0 else torch.ones_like(out))
        del out
        if windows:
            windows.mark("optimizer")
        if self.optimizer is not None:
            self.optimizer.step()
            if not self.grads_persist:
                self.optimizer.zero_grad(set_to_none=True)
        if windows:
            windows.mark("end")

    def measure(self, plan: Plan, on_mark: Callable[[str, int], None] | None = None,
                sample: Callable[[Meter], Any] | None = None) -> _Record:
        """One step's windows; `on_mark(name, peak of the window before)` as each begins;
        `sample(meter)` wraps the step."""
        apply(self.model, replace(plan, min_offloaded_tensor_size=self.min_offloaded))
        if self.cuda:  # a warm-up step: compiled regions compile, lazily allocated state appears
            self.step()
            torch.cuda.synchronize()
            meter: Any = CudaMeter(self.batch[0].device)
            context: Any = nullcontext()
        else:
            meter = context = CpuMeter(held_tensors(self.model, self.optimizer))
        sites = find_sites(self.model).layers
        offloader = offloader_of(self.model)
        if offloader is not None:
            offloader.reset_stats()
        with context, (sample(meter) if sample is not None else nullcontext()):
            windows = _Windows(meter, sites, on_mark)
            meter.take_peak()
            try:
                self.step(windows, meter)
            finally:
                record = windows.close()
        record.peaks.pop("end", None)
        if offloader is not None:
            record.host_bytes = offloader.stats().offloaded_bytes
        return record

    def site_storages(self) -> dict[Owner, SiteStorages]:
        """What each site saves for backward in a no-recompute step: a step of its own, since the
        saved-tensor hook that notes it would run inside the measured ones."""
        apply(self.model, None)
        found: dict[Owner, SiteStorages] = {}
        with Attributor(self.model, self.optimizer) as attributor:
            self.step(after_forward=lambda: found.update(attributor.sites()))
        return found

    def seconds(self, plan: Plan, repeats: int) -> float:
        """Median step time under `plan` (CUDA events on GPU, wall clock on CPU); on the meta
        device, where nothing runs, the step's counted FLOPs at `flops_per_s`."""
        apply(self.model, replace(plan, min_offloaded_tensor_size=self.min_offloaded))
        if self.batch[0].device.type == "meta":
            if self.flops_per_s is None:
                raise ValueError("a trace on the meta device times steps by their FLOPs: pass flops_per_s")
            with FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS) as counter:
                self.step()
            return counter.get_total_flops() / self.flops_per_s
        if self.cuda:
            repeats = timing_repeats(repeats, self._timed_step())  # the warm-up step sizes the rest
        times = [self._timed_step() for _ in range(repeats)]
        return sorted(times)[len(times) // 2]

    def _timed_step(self) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            self.step()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


# per action on a GPU: timing 3 steps of 50 ms (2 Llama-3-8B layers), one action's cost moved from
# 2.5 to 4.1 ms between two calls (benchmarks/results/cli_cuda_h200.txt, plan_cli_8b_2layers_h200.txt)
MIN_TIMED_S = 1.0
MAX_TIMING_REPEATS = 25


def timing_repeats(repeats: int, step_s: float) -> int:
    """How many steps to time: at least `repeats`, and enough short steps to fill MIN_TIMED_S."""
    if step_s <= 0:
        return max(repeats, MAX_TIMING_REPEATS)
    return max(repeats, min(MAX_TIMING_REPEATS, -int(-MIN_TIMED_S // step_s)))


def _attention_flops(bmms: int) -> Callable[..., int]:
    """`bmms` matmuls of attention's [s_q, d] x [d, s_k] size per query head; key/value heads may
    be fewer (GQA), which torch < 2.13's own formula rejects."""
    def flops(*shapes: Any, out_shape: Any = None, **kwargs: Any) -> int:
        query, key = (shapes[1], shapes[2]) if bmms > 2 else (shapes[0], shapes[1])
        b, h, s_q, d = query
        return bmms * 2 * b * h * s_q * key[2] * d
    return flops


def _addmm_flops(self_shape: Any, a_shape: Any, b_shape: Any, *rest: Any, out_shape: Any = None,
                 **kwargs: Any) -> int:
    """A matmul that adds into its input (the loss head's weight gradient). torch's own formula
    takes addmm's out_dtype for its out_shape and fails, and counts nothing for addmm_."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


_aten = torch.ops.aten
_FLOP_FORMULAS = {
    _aten.addmm: _addmm_flops,
    _aten.addmm_: _addmm_flops,
    **{op: _attention_flops(2) for op in (_aten._scaled_dot_product_cudnn_attention,
                                          _aten._scaled_dot_product_flash_attention)},
    **{op: _attention_flops(5) for op in (_aten._scaled_dot_product_cudnn_attention_backward,
                                          _aten._scaled_dot_product_flash_attention_backward)},
}


def trace(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], *,
          optimizer: torch.optim.Optimizer | None = None, micro_batches: int = 1,
          timing_repeats: int = 3, seed: int = 0, flops_per_s: float | None = None,
          offload: bool = False, min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE,
          host_bytes_per_s: float | None = None, progress: Callable[[str], None] | None = None) -> Trace:
    """Measure, with training steps on `batch` (input_ids, labels, as `remat.plan` takes it),
    what every action saves and costs in every layer.

    The step is `remat bench`'s: forward, backward, then `optimizer` (None: gradients accumulate
    across steps, as `bench --no_optimizer` runs). The optimizer's learning rate is 0 while
    tracing, so the weights do not change, and the gradients and optimizer state are put back as
    they were when it returns. The model is left with no plan.
    On the meta device (shapes only) memory is counted by storage and time is FLOPs / flops_per_s.
    A model that returns hidden states rather than a loss (a pipeline stage) gets their gradient.
    `offload`: measure offload actions too (pinned host memory on CUDA; about twice the steps),
    with storages below `min_offloaded_tensor_size` elements kept on the device; on the meta device
    the copies are timed at `host_bytes_per_s`, hidden behind the next layer's forward and backward.
    """
    sites = find_sites(model)
    layout = sites.layout
    if not layout.has_layer_sites:
        raise ConfigError([Problem("model", "trace needs a Site('layer') around each transformer layer "
                                            "to tell one layer's memory from the next; add layer Sites")])
    input_ids, labels = batch
    problems = list(planning_problems(offload, None, input_ids.device.type, host_bytes_per_s))
    if problems:
        raise ConfigError(problems)
    note = progress or (lambda message: None)
    n = layout.num_layers
    stepper = _Stepper(model, (input_ids, labels), optimizer, gradients_persist(optimizer, micro_batches), seed,
                       flops_per_s, min_offloaded_tensor_size, host_bytes_per_s)
    gc.collect()
    gc.freeze()  # the collections that settle each step's saved bytes then scan only what steps create
    try:
        with _training_state_kept(model, optimizer):
            stepper.step()  # the state a steady step starts from: gradients, optimizer moments
            note("baseline")
            base = stepper.measure(Plan.none(n))
            base_time = stepper.seconds(Plan.none(n), timing_repeats)
            storages = stepper.site_storages()
            kinds: dict[tuple[Any, ...], list[int]] = {}
            for i in range(n):
                kinds.setdefault(_signature(model, sites.layers[i], layout.labels[i]), []).append(i)
            effects: dict[int, LayerEffects] = {}
            for indices in kinds.values():
                measured = _measure_kind(stepper, base, base_time, indices, layout, timing_repeats, offload,
                                         note)
                effects.update((i, measured) for i in indices)
    finally:
        gc.unfreeze()
        apply(model, None)
    windows = tuple(Window(name, *_window_place(name, n), peak) for name, peak in base.peaks.items())
    return Trace(layout, base.saved_bytes, base_time, windows, tuple(effects[i] for i in range(n)),
                 offload=offload, min_offloaded_tensor_size=min_offloaded_tensor_size,
                 fixed_bytes=base.held_bytes + (0 if stepper.grads_persist else storage_bytes(
                     p for p in model.parameters() if p.requires_grad)),
                 storages=storages)


@contextmanager
def _training_state_kept(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """The steps inside leave the model and optimizer as they found them: the optimizer steps with
    learning rate 0 (the weights do not move), and the gradients and optimizer state they fill are
    put back afterwards, from host copies (device copies would count in the peaks measured)."""
    groups = optimizer.param_groups if optimizer is not None else []
    rates = [group["lr"] for group in groups]
    grads = {p: _host_copy(p.grad) for p in model.parameters() if p.grad is not None}
    states = {p: {k: _host_copy(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
              for p, state in (optimizer.state.items() if optimizer is not None else ())}
    for group in groups:
        group["lr"] = 0.0
    try:
        yield
    finally:
        for group, rate in zip(groups, rates):
            group["lr"] = rate
        for param in model.parameters():
            param.grad = grads[param].to(param.device) if param in grads else None
        if optimizer is not None:
            for begun in [p for p in optimizer.state if p not in states]:  # the steps began it
                del optimizer.state[begun]
            for key_param, state in states.items():  # into the optimizer's own tensors: devices kept
                now = optimizer.state[key_param]
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and isinstance(now.get(key), torch.Tensor):
                        now[key].copy_(value)
                    else:
                        now[key] = value


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy off the device (shapes only on meta, which holds no data)."""
    return tensor.detach().clone() if tensor.device.type == "meta" else tensor.detach().to("cpu", copy=True)


@dataclass(frozen=True)
class Timeline:
    """Memory after every op of one training step, with the windows marked where they begin."""

    allocated: tuple[int, ...]
    reserved: tuple[int, ...] | None  # the caching allocator's (CUDA only)
    marks: tuple[tuple[int, str], ...]  # (op index, window name): fwd i, head, bwd i, tail, optimizer
    peaks: dict[str, int]  # each window's peak, as the trace measures it


class _Samples:
    """Allocated (and on CUDA reserved) bytes, appended as the step goes."""

    def __init__(self, meter: Meter, cuda: bool) -> None:
        self.meter, self.cuda = meter, cuda
        self.allocated: list[int] = []
        self.reserved: list[int] = []

    def sample(self, allocated: int | None = None) -> None:
        self.allocated.append(self.meter.now() if allocated is None else allocated)
        if self.cuda:
            self.reserved.append(torch.cuda.memory_reserved())


class _EveryOp(TorchDispatchMode):
    def __init__(self, samples: _Samples) -> None:
        super().__init__()
        self.samples = samples

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.samples.sample()
        return out


def timeline(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], *,
             optimizer: torch.optim.Optimizer | None = None, plan: RecomputeConfig | Plan | None = None,
             micro_batches: int = 1, seed: int = 0, per_op: bool = True) -> Timeline:
    """Allocated (and on CUDA reserved) bytes after every op of one training step on `batch`
    (input_ids, labels) under `plan`, the step `trace` measures, with each layer's forward and
    backward marked. With compiled regions pass per_op=False: samples then come at each window's
    start and peak only (a dispatch mode watching every op would run compiled regions eagerly and
    change what they save)."""
    resolved = _resolve(plan, find_sites(model).layout)
    stepper = _Stepper(model, batch, optimizer, gradients_persist(optimizer, micro_batches), seed,
                       min_offloaded=resolved.min_offloaded_tensor_size)
    marks: list[tuple[int, str]] = []
    found: list[_Samples] = []

    def sample(meter: Meter) -> Any:
        found.append(_Samples(meter, stepper.cuda))
        return _EveryOp(found[0]) if per_op else nullcontext()

    def on_mark(name: str, peak: int) -> None:
        samples = found[0]
        if not per_op:  # the window that ended reached `peak`; the next one starts from now
            samples.sample(peak)
            samples.sample()
        marks.append((len(samples.allocated) - (0 if per_op else 1), name))

    try:
        with _training_state_kept(model, optimizer):
            stepper.step()  # gradients and optimizer state exist, as in a steady step
            record = stepper.measure(resolved, on_mark, sample)
    finally:
        apply(model, None)
    (samples,) = found
    return Timeline(tuple(samples.allocated), tuple(samples.reserved) if stepper.cuda else None,
                    tuple(m for m in marks if m[1] != "end"), dict(record.peaks))


def _window_place(name: str, n: int) -> tuple[int | None, int]:
    """(the layer whose forward or backward runs in the window, how many layers' saved tensors it holds)."""
    for phase in ("fwd", "bwd"):
        if name.startswith(phase):
            layer = int(name[len(phase):])
            return layer, layer
    return None, n if name == "head" else 0


def _measure_kind(stepper: _Stepper, base: _Record, base_time: float, indices: list[int],
                  layout: ModelLayout, repeats: int, offload: bool, note: Callable[[str], None]) -> LayerEffects:
    n, r = layout.num_layers, max(indices)  # the last layer of the kind has predecessors to group with
    # offload is measured where a next layer exists: its windows are the copies' windows
    followed = [i for i in indices if i + 1 < n]

    def effect(plan: Plan, start: int, end: int, reach: int = 0) -> Effect:
        run = stepper.measure(plan)
        windows = {(phase, j - start): run.peaks[f"{phase}{j}"] - base.peaks[f"{phase}{j}"]
                   for j in range(start, end + reach) for phase in ("fwd", "bwd")}
        return Effect(base.saved_bytes - run.saved_bytes, windows, host_bytes=run.host_bytes)

    def added_time(plan: Plan, layers: list[int]) -> float:  # every layer of the kind at once: above the noise
        return max(0.0, stepper.seconds(plan, repeats) - base_time) / len(layers)

    note(f"layer {r}: full recompute")
    layer_time = added_time(Plan(Plan.none(n).layers, [(i, i + 1) for i in indices]), indices)

    def copy_time(host_bytes: int) -> float:
        """On the meta device, where nothing runs: what the next layer's forward (copies out) and
        backward (copies back; about twice the forward) do not hide of one layer's copies."""
        if stepper.host_bytes_per_s is None or not host_bytes:
            return 0.0
        each_way = host_bytes / stepper.host_bytes_per_s
        return max(0.0, each_way - layer_time) + max(0.0, each_way - 2 * layer_time)

    def measure_combo(combo: Combo) -> Effect:
        """Its memory; its time too for one action alone, or with offload (recomputing more leaves
        less to copy: not a sum)."""
        note(f"layer {r}: " + (", ".join(f"{k}={v}" for k, v in sorted(combo)) or "keep"))
        at, layers = (max(followed), followed) if _offloads(combo) else (r, indices)
        plan = Plan.none(n)
        plan.layers[at] = dict(combo)
        measured = effect(plan, at, at + 1, reach=1 if _offloads(combo) else 0)
        if len(combo) != 1 and not _offloads(combo):
            return measured
        everywhere = Plan.none(n)
        for i in layers:
            everywhere.layers[i] = dict(combo)
        return replace(measured, added_time_s=added_time(everywhere, layers) + copy_time(measured.host_bytes))

    combos = _summed_times({combo: measure_combo(combo) for combo in _combos(layout.labels[r])})
    if offload and followed:
        combos.update((combo, measure_combo(combo)) for combo in _offload_combos(layout.labels[r]))
    groups = {size: effect(Plan(Plan.none(n).layers, [(r + 1 - size, r + 1)]), r + 1 - size, r + 1)
              for size in MEASURED_GROUP_SIZES if size <= r + 1}
    groups = {size: replace(e, added_time_s=size * layer_time) for size, e in groups.items()}
    # one group over layers r-1 and r frees layer r's input as well
    input_bytes = groups[2].freed_bytes - 2 * groups[1].freed_bytes if 2 in groups else 0
    offloaded: dict[int, Effect] = {}
    if offload and followed:
        p = max(followed)
        note(f"layer {p}: full recompute, input offloaded")
        offloaded = {size: effect(_inputs_offloaded(n, [(p + 1 - size, p + 1)]), p + 1 - size, p + 1, reach=1)
                     for size in MEASURED_GROUP_SIZES if size <= p + 1}
        # the copies' cost on top of the recompute: every followed layer of the kind in a group of one
        copies = (max(0.0, added_time(_inputs_offloaded(n, [(i, i + 1) for i in followed]), followed) - layer_time)
                  + copy_time(offloaded[1].host_bytes))
        offloaded = {size: replace(e, added_time_s=size * layer_time + copies) for size, e in offloaded.items()}
    return LayerEffects(combos, groups, input_bytes, layer_time, offloaded)


def _summed_times(combos: dict[Combo, Effect]) -> dict[Combo, Effect]:
    """A combination of recompute and discard actions costs the time of each, measured alone."""
    return {combo: replace(e, added_time_s=sum(combos[frozenset({pair})].added_time_s for pair in combo))
            for combo, e in combos.items()}


def _inputs_offloaded(n: int, ranges: list[tuple[int, int]]) -> Plan:
    """Full recompute of `ranges`, each range's kept input offloaded."""
    plan = Plan(Plan.none(n).layers, ranges)
    for start, _ in ranges:
        plan.layers[start][LAYER] = "offload"
    return plan


def _first_of_each_kind(trace: Trace) -> Iterator[tuple[int, LayerEffects]]:
    """(layer, its effects) for the first layer of each kind (layers of a kind share one LayerEffects)."""
    seen: set[int] = set()
    for i, effects in enumerate(trace.layers):
        if id(effects) not in seen:
            seen.add(id(effects))
            yield i, effects


def describe_sites(trace: Trace) -> Iterator[tuple[str, SiteStorages, int | None]]:
    """(site, what it saves in a no-recompute step, what recomputing it alone (discarding, for a
    discard-only site) frees as measured)
    for the first layer of each kind ("other ops": the layer's ops outside its sites), then the
    embedding and the loss head (nothing measured for those)."""
    for i, effects in _first_of_each_kind(trace):
        for label in [*sorted(trace.layout.labels[i]), LAYER]:
            if (i, label) in trace.storages:
                alone = effects.combos.get(frozenset({(label, "discard" if label in DISCARD_ONLY else "recompute")}))
                yield owner_name((i, label)), trace.storages[(i, label)], None if alone is None else alone.freed_bytes
    for owner, storages in trace.storages.items():
        if owner[0] is None:
            yield owner_name(owner), storages, None


def describe(trace: Trace) -> Iterator[tuple[str, int, float]]:
    """(combination, bytes freed per layer, ms added per layer) for the first layer of each kind."""
    for _, effects in _first_of_each_kind(trace):
        for combo, effect in effects.combos.items():
            yield (", ".join(f"{k}={v}" for k, v in sorted(combo)) or "keep", effect.freed_bytes,
                   effect.added_time_s * 1e3)
        yield "full recompute", effects.groups[1].freed_bytes, effects.layer_time_s * 1e3
        if effects.offloaded_groups:
            offloaded = effects.offloaded_groups[1]
            yield "full recompute, input offloaded", offloaded.freed_bytes, offloaded.added_time_s * 1e3
