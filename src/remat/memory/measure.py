"""trace(): measure what every site action saves and costs, per layer, with training steps.

One instrumented training step per action, on one representative layer of each kind, records
the bytes the forward leaves saved and the peak of every memory window of the step: the forward
and the backward of each layer, the loss head between them, the rest of the backward and the
optimizer step (`remat.memory.windows`). Recompute cost is the step time added when every layer
of the kind runs one action, per layer; a combination adds the work of each of its actions, one
after another, so it costs their sum.

With `offload=True` the trace also measures offloading: each combination with the rest of the
layer offloaded, each site offloaded alone, and recompute groups with their input offloaded.
Offload reaches one layer further than recompute: the copies out may still run during the next
layer's forward, and the copies back start when the next layer's backward begins, so those two
windows are measured as well (on a layer that has a next one).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from remat.config.fields import MIN_OFFLOADED_TENSOR_SIZE
from remat.config.model_sites import ModelSites
from remat.config.plan import Plan
from remat.core.labels import LAYER
from remat.core.problems import Problem, raise_if_any
from remat.core.timing import spread
from remat.memory.attribution import Attributor, Owner, SiteStorages
from remat.memory.flops import FLOP_FORMULAS, TimedFlopCounter
from remat.memory.meter import CpuMeter, CudaMeter, Meter, held_tensors, storage_bytes
from remat.memory.prediction import (
    MEASURED_GROUP_SIZES,
    Combo,
    Effect,
    LayerEffects,
    Trace,
    combos,
    offload_combos,
    offloads,
)
from remat.memory.windows import Window
from remat.sites.apply import FoundSites, apply, find_sites, offloader_of
from remat.sites.calls import LossFn, forward_loss, with_loss
from remat.sites.site import Site

# Host link bandwidth assumed for offload copies on the meta device, each way: pinned copies on the
# H200 measured 55 GB/s (benchmarks/README.md).
DEFAULT_HOST_GBPS = 55.0


def meta_offload_problems(offload: bool, device_type: str, host_bytes_per_s: float | None) -> Iterator[Problem]:
    """A shapes-only trace that measures offload needs a host bandwidth to time the copies it cannot run."""
    if offload and device_type == "meta" and not (host_bytes_per_s or 0) > 0:
        yield Problem(
            "host_gbps",
            "a shapes-only trace (meta device) runs no copies: give the host link's "
            f"bandwidth to time them (host_bytes_per_s; `--host_gbps`, e.g. "
            f"{DEFAULT_HOST_GBPS:g})",
        )


def _signature(model: nn.Module, site: Site, labels: frozenset[str]) -> tuple[Any, ...]:
    """Layers with equal signatures behave alike: same site labels, same parameter shapes."""
    owner = next(m for m in model.modules() if any(child is site for child in m.children()))
    return labels, tuple((n, tuple(p.shape), p.dtype) for n, p in owner.named_parameters())


# ---- one instrumented step ------------------------------------------------------------------


@dataclass
class StepRecord:
    held_bytes: int = 0  # allocated when the step starts
    saved_bytes: int = 0
    peaks: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0  # offloaded during the step


class WindowMarks:
    """Marks the windows of a step with hooks on the layer Sites and on the layers' activations."""

    def __init__(
        self, meter: Meter, layer_sites: list[Site], on_mark: Callable[[str, int], None] | None = None
    ) -> None:
        self.meter, self.last = meter, len(layer_sites) - 1
        self.on_mark = on_mark
        self.record = StepRecord()
        self.current = "pre"
        self.backward = False  # once backward runs, forwards are recompute replays: not windows
        self.handles = [
            h
            for i, site in enumerate(layer_sites)
            for h in (
                site.register_forward_pre_hook(lambda m, args, i=i: self._enter(i, args[1])),
                site.register_forward_hook(lambda m, args, out, i=i: self._exit(i, out)),
            )
        ]

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
        if isinstance(out, (tuple, list)) and out:  # older HF layers return (hidden, cache, ...)
            out = out[0]
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._on_grad(f"bwd{i}"))

    def close(self) -> StepRecord:
        for h in self.handles:
            h.remove()
        return self.record


def gradients_persist(optimizer: torch.optim.Optimizer | None, micro_batches: int) -> bool:
    """Whether gradients exist when a step starts: they accumulate across steps without an
    optimizer, and across micro-batches with several; otherwise the optimizer step frees them and
    backward builds them again."""
    return optimizer is None or micro_batches > 1


@dataclass
class Stepper:
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

    def step(
        self,
        windows: WindowMarks | None = None,
        meter: Meter | None = None,
        after_forward: Callable[[], None] | None = None,
    ) -> None:
        torch.manual_seed(self.seed)
        before = meter.now() if meter else 0
        out = forward_loss(self.model, *self.batch)
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

    def measure(
        self,
        plan: Plan,
        on_mark: Callable[[str, int], None] | None = None,
        sample: Callable[[Meter], Any] | None = None,
    ) -> StepRecord:
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
        with context, sample(meter) if sample is not None else nullcontext():
            windows = WindowMarks(meter, sites, on_mark)
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
        return self.timing(plan, repeats)[0]

    def timing(self, plan: Plan, repeats: int) -> tuple[float, float]:
        """The median step time under `plan` and its noise (timing.spread of the steps timed; 0 on
        the meta device, where steps are counted, not run)."""
        apply(self.model, replace(plan, min_offloaded_tensor_size=self.min_offloaded))
        if self.batch[0].device.type == "meta":
            if self.flops_per_s is None:
                raise ValueError("a trace on the meta device times steps by their FLOPs: pass flops_per_s")
            with TimedFlopCounter(display=False, custom_mapping=FLOP_FORMULAS) as counter:
                self.step()
            return counter.time_flops / self.flops_per_s, 0.0
        if self.cuda:
            repeats = timing_repeats(repeats, self._timed_step())  # the warm-up step sizes the rest
        times = sorted(self._timed_step() for _ in range(repeats))
        return times[len(times) // 2], spread(times)

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


# per action on a GPU: a few short steps timed too few to tell an action's cost from noise
# (benchmarks/README.md), so at least a second of steps is timed
MIN_TIMED_S = 1.0
MAX_TIMING_REPEATS = 25


def timing_repeats(repeats: int, step_s: float) -> int:
    """How many steps to time: at least `repeats`, and enough short steps to fill MIN_TIMED_S."""
    if step_s <= 0:
        return max(repeats, MAX_TIMING_REPEATS)
    return max(repeats, min(MAX_TIMING_REPEATS, -int(-MIN_TIMED_S // step_s)))


def _layer_site_problems(model_sites: ModelSites) -> Iterator[Problem]:
    if not model_sites.has_layer_sites:
        yield Problem(
            "model",
            "trace needs a Site('layer') around each transformer layer to tell one layer's memory"
            " from the next; add layer Sites",
        )


def _effects(
    model: nn.Module,
    sites: FoundSites,
    stepper: Stepper,
    base: Any,
    base_time: float,
    timing_repeats: int,
    note: Callable[[str], None],
    offload: bool,
) -> tuple[LayerEffects, ...]:
    """Every layer's effects, measured once per kind of layer (its labels and its code)."""
    model_sites = sites.model_sites
    kinds: dict[tuple[Any, ...], list[int]] = {}
    for i in range(model_sites.num_layers):
        kinds.setdefault(_signature(model, sites.layers[i], model_sites.labels[i]), []).append(i)
    effects: dict[int, LayerEffects] = {}
    for indices in kinds.values():
        measured = KindMeasurement(stepper, base, base_time, indices, model_sites, timing_repeats, note).measure(
            offload
        )
        effects.update((i, measured) for i in indices)
    return tuple(effects[i] for i in range(model_sites.num_layers))


def trace(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    micro_batches: int = 1,
    timing_repeats: int = 3,
    seed: int = 0,
    flops_per_s: float | None = None,
    offload: bool = False,
    min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE,
    host_bytes_per_s: float | None = None,
    progress: Callable[[str], None] | None = None,
    loss_fn: LossFn | None = None,
) -> Trace:
    """Measure, with training steps on `batch` (input_ids, labels, as `remat.plan` takes it),
    what every action saves and costs in every layer; a model that returns logits takes
    `loss_fn(output, labels)` (e.g. `remat.cross_entropy`).

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
    model = with_loss(model, loss_fn)
    sites = find_sites(model)
    model_sites = sites.model_sites
    input_ids, labels = batch
    raise_if_any(
        [*_layer_site_problems(model_sites), *meta_offload_problems(offload, input_ids.device.type, host_bytes_per_s)]
    )
    stepper = Stepper(
        model,
        (input_ids, labels),
        optimizer,
        gradients_persist(optimizer, micro_batches),
        seed,
        flops_per_s,
        min_offloaded_tensor_size,
        host_bytes_per_s,
    )
    return _measured_trace(stepper, sites, timing_repeats, progress or (lambda message: None), offload)


def _measured_trace(
    stepper: Stepper, sites: FoundSites, timing_repeats: int, note: Callable[[str], None], offload: bool
) -> Trace:
    """`trace`'s measurements, from the no-plan baseline to each action's effects."""
    model, n = stepper.model, sites.model_sites.num_layers
    gc.collect()
    gc.freeze()  # the collections that settle each step's saved bytes then scan only what steps create
    try:
        with training_state_kept(model, stepper.optimizer):
            stepper.step()  # the state a steady step starts from: gradients, optimizer moments
            note("baseline")
            base = stepper.measure(Plan.none(n))
            base_time, noise = stepper.timing(Plan.none(n), timing_repeats)
            storages = stepper.site_storages()
            effects = _effects(model, sites, stepper, base, base_time, timing_repeats, note, offload)
    finally:
        gc.unfreeze()
        apply(model, None)
    windows = tuple(Window(name, *_window_place(name, n), peak) for name, peak in base.peaks.items())
    return Trace(
        sites.model_sites,
        base.saved_bytes,
        base_time,
        windows,
        effects,
        step_noise_s=noise,
        timed_on=stepper.batch[0].device.type,
        offload=offload,
        min_offloaded_tensor_size=stepper.min_offloaded,
        fixed_bytes=base.held_bytes
        + (0 if stepper.grads_persist else storage_bytes(p for p in model.parameters() if p.requires_grad)),
        storages=storages,
    )


@contextmanager
def training_state_kept(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """The steps inside leave the model and optimizer as they found them: the optimizer steps with
    learning rate 0 (the weights do not move), and the gradients and optimizer state they fill are
    put back afterwards, from host copies (device copies would count in the peaks measured)."""
    groups = optimizer.param_groups if optimizer is not None else []
    rates = [group["lr"] for group in groups]
    grads = {p: _host_copy(p.grad) for p in model.parameters() if p.grad is not None}
    states = {
        p: {k: _host_copy(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        for p, state in (optimizer.state.items() if optimizer is not None else ())
    }
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


def _window_place(name: str, n: int) -> tuple[int | None, int]:
    """(the layer whose forward or backward runs in the window, how many layers' saved tensors it holds)."""
    for phase in ("fwd", "bwd"):
        if name.startswith(phase):
            layer = int(name[len(phase) :])
            return layer, layer
    return None, n if name == "head" else 0


class KindMeasurement:
    """The measurements of one kind of layer (layers of equal signature), against the baseline step.

    Memory is measured on the kind's last layer (it has predecessors to group with; offload on the
    last that has a next layer, whose windows the copies reach). Time is measured with every layer
    of the kind running the action at once, so the added time stands above the noise, per layer.
    """

    def __init__(
        self,
        stepper: Stepper,
        base: StepRecord,
        base_time: float,
        indices: list[int],
        model_sites: ModelSites,
        repeats: int,
        note: Callable[[str], None],
    ) -> None:
        self.stepper, self.base, self.base_time = stepper, base, base_time
        self.indices, self.repeats, self.note = indices, repeats, note
        self.n, self.last = model_sites.num_layers, max(indices)
        self.labels = model_sites.labels[self.last]
        self.followed = [i for i in indices if i + 1 < self.n]  # layers with a next one
        self.layer_time = 0.0  # one layer's full recompute: set by measure()

    def measure(self, offload: bool) -> LayerEffects:
        self.note(f"layer {self.last}: full recompute")
        self.layer_time = self.added_time(self._groups_of_one(self.indices), self.indices)
        measured = _summed_times({c: self.combo(c) for c in combos(self.labels)})
        offload = offload and bool(self.followed)
        if offload:
            measured.update((c, self.combo(c)) for c in offload_combos(self.labels))
        r = self.last
        groups = {
            size: replace(
                self.effect(Plan(Plan.none(self.n).layers, [(r + 1 - size, r + 1)]), r + 1 - size, r + 1),
                added_time_s=size * self.layer_time,
            )
            for size in MEASURED_GROUP_SIZES
            if size <= r + 1
        }
        # one group over layers r-1 and r frees layer r's input as well
        input_bytes = groups[2].freed_bytes - 2 * groups[1].freed_bytes if 2 in groups else 0
        return LayerEffects(measured, groups, input_bytes, self.layer_time, self.offloaded_groups() if offload else {})

    def effect(self, plan: Plan, start: int, end: int, reach: int = 0) -> Effect:
        """The memory of layers [start, end) (and `reach` more) under `plan`, against the baseline."""
        run, base = self.stepper.measure(plan), self.base
        windows = {
            (phase, j - start): run.peaks[f"{phase}{j}"] - base.peaks[f"{phase}{j}"]
            for j in range(start, end + reach)
            for phase in ("fwd", "bwd")
        }
        return Effect(base.saved_bytes - run.saved_bytes, windows, host_bytes=run.host_bytes)

    def added_time(self, plan: Plan, layers: list[int]) -> float:
        """Step time `plan` adds, per layer of `layers` (all of which it acts on)."""
        return max(0.0, self.stepper.seconds(plan, self.repeats) - self.base_time) / len(layers)

    def copy_time(self, host_bytes: int) -> float:
        """On the meta device, where nothing runs: what the next layer's forward (copies out) and
        backward (copies back; about twice the forward) do not hide of one layer's copies."""
        if self.stepper.host_bytes_per_s is None or not host_bytes:
            return 0.0
        each_way = host_bytes / self.stepper.host_bytes_per_s
        return max(0.0, each_way - self.layer_time) + max(0.0, each_way - 2 * self.layer_time)

    def combo(self, combo: Combo) -> Effect:
        """Its memory; its time too for one action alone, or with offload (recomputing more leaves
        less to copy: not a sum)."""
        self.note(f"layer {self.last}: " + (", ".join(f"{k}={v}" for k, v in sorted(combo)) or "keep"))
        at, layers = (max(self.followed), self.followed) if offloads(combo) else (self.last, self.indices)
        plan = Plan.none(self.n)
        plan.layers[at] = dict(combo)
        measured = self.effect(plan, at, at + 1, reach=1 if offloads(combo) else 0)
        if len(combo) != 1 and not offloads(combo):
            return measured
        everywhere = Plan.none(self.n)
        for i in layers:
            everywhere.layers[i] = dict(combo)
        return replace(measured, added_time_s=self.added_time(everywhere, layers) + self.copy_time(measured.host_bytes))

    def offloaded_groups(self) -> dict[int, Effect]:
        """Recompute groups ending at the kind's last followed layer, their kept input offloaded."""
        p = max(self.followed)
        self.note(f"layer {p}: full recompute, input offloaded")
        measured = {
            size: self.effect(_inputs_offloaded(self.n, [(p + 1 - size, p + 1)]), p + 1 - size, p + 1, reach=1)
            for size in MEASURED_GROUP_SIZES
            if size <= p + 1
        }
        # the copies' cost on top of the recompute: every followed layer of the kind in a group of one
        everywhere = _inputs_offloaded(self.n, [(i, i + 1) for i in self.followed])
        copies = max(0.0, self.added_time(everywhere, self.followed) - self.layer_time) + self.copy_time(
            measured[1].host_bytes
        )
        return {size: replace(e, added_time_s=size * self.layer_time + copies) for size, e in measured.items()}

    def _groups_of_one(self, layers: list[int]) -> Plan:
        return Plan(Plan.none(self.n).layers, [(i, i + 1) for i in layers])


def _summed_times(effects: dict[Combo, Effect]) -> dict[Combo, Effect]:
    """A combination of recompute and discard actions costs the time of each, measured alone."""
    return {
        combo: replace(e, added_time_s=sum(effects[frozenset({pair})].added_time_s for pair in combo))
        for combo, e in effects.items()
    }


def _inputs_offloaded(n: int, ranges: list[tuple[int, int]]) -> Plan:
    """Full recompute of `ranges`, each range's kept input offloaded."""
    plan = Plan(Plan.none(n).layers, ranges)
    for start, _ in ranges:
        plan.layers[start][LAYER] = "offload"
    return plan
