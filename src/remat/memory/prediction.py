"""What a trace measured, and any plan's memory and time predicted from it.

Layers interact only through the residual stream, so an action changes the windows of its own
layers by what was measured (`Effect.window_bytes`), every later window that still holds its
saved tensors by the bytes it frees, and nothing else. Summing those effects predicts any plan
(`Trace.predict`), and the planner optimizes over the same sums (`Trace.problem`).

A layer's sites do interact (a discarded norm output is also the MLP's input), so the memory of
every combination of actions in a layer is measured, not each site alone; an action at a site
that an enclosing recomputed site replays (`mlp_act` inside `mlp`) does nothing and is dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from remat.config.fields import MIN_OFFLOADED_TENSOR_SIZE
from remat.config.model_sites import ModelSites, check_config
from remat.config.plan import Plan, check_plan
from remat.config.recompute import RecomputeConfig
from remat.core.labels import LAYER, discard_labels, discard_only_labels, enclosing, offload_only_labels
from remat.core.problems import ConfigError, Problem
from remat.memory.attribution import Owner, SiteStorages, owner_name
from remat.memory.windows import Choice, PlanningProblem, Window

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
        fwd_step = m.window_bytes[("fwd", largest - 1)] - m.window_bytes[("fwd", largest - 2)] if largest > 1 else 0
        windows: dict[Offset, int] = {}
        for q in range(size):
            source = min(q, max(largest - 2, 0)) if q < size - 1 else largest - 1
            windows[("bwd", q)] = m.window_bytes[("bwd", source)]
            windows[("fwd", q)] = m.window_bytes[("fwd", source)] + (q - source) * fwd_step
        freed = m.freed_bytes + (size - largest) * (self.groups[1].freed_bytes + self.input_bytes)
        # the next layer's windows (offload's reach) hold the group's layers freed: the extra ones too
        windows.update(
            {(phase, size): b - (freed - m.freed_bytes) for (phase, q), b in m.window_bytes.items() if q == largest}
        )
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
    model_sites: ModelSites
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
    # the no-recompute steps' spread (timing.spread): a step time, or an action's cost summed over
    # the layers it was timed on, within this of another is noise
    step_noise_s: float = 0.0
    timed_on: str = "cuda"  # the device type the steps ran on ("meta": counted FLOPs, not run)

    def choice(self, start: int, end: int, actions: dict[str, str] | None, offload_input: bool = False) -> Choice:
        """Layers [start, end) run one way: `actions` for one layer, None for a recompute group
        (with `offload_input`, its input goes to host)."""
        if actions is None:
            effect = self.offloaded_group(start, end) if offload_input else self.layers[end - 1].group(end - start)
        else:
            effect = self._combo_effect(start, combo_of(actions))
        windows = {f"{phase}{start + q}": b for (phase, q), b in effect.window_bytes.items()}
        return Choice(
            start,
            end,
            None if actions is None else dict(actions),
            effect.freed_bytes,
            effect.added_time_s,
            windows,
            effect.host_bytes,
            offload_input,
        )

    def offloaded_group(self, start: int, end: int) -> Effect:
        effects = self.layers[end - 1]
        if not effects.offloaded_groups:
            raise ConfigError(
                [
                    Problem(
                        f"layers[{start}]",
                        f"the trace measured no offloaded recompute input for "
                        f"the kind of layer {end - 1} (no layer of that kind has a"
                        f" next one); keep the input of [{start}, {end}) on the GPU",
                    )
                ]
            )
        return effects.group(end - start, offload_input=True)

    def _combo_effect(self, layer: int, combo: Combo) -> Effect:
        effects = self.layers[layer].combos
        if combo not in effects:
            raise ConfigError([_unmeasured(layer, combo)])
        return effects[combo]

    def choices(self) -> list[Choice]:
        """Every way to run every layer: each site combination, each recompute group. Offload
        only where a later layer's backward leaves time to copy the tensors back."""
        n = self.model_sites.num_layers
        out = [
            self.choice(i, i + 1, dict(combo))
            for i in range(n)
            for combo in self.layers[i].combos
            if i < n - 1 or not offloads(combo)
        ]
        if self.model_sites.has_layer_sites:
            out += [self.choice(s, e, None) for s in range(n) for e in range(s + 1, min(n, s + self.max_group) + 1)]
            out += [
                self.choice(s, e, None, offload_input=True)
                for s in range(n)
                for e in range(s + 1, min(n - 1, s + self.max_group) + 1)
                if self.layers[e - 1].offloaded_groups
            ]
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
        useful = [
            c
            for c in choices
            if not c.actions
            or (_frees_something(c) and not any(_no_worse_with_fewer_actions(other, c) for other in by_layer[c.start]))
        ]
        return PlanningProblem(self.model_sites.num_layers, useful, self.windows, self.fixed_bytes)

    def predict(self, plan: RecomputeConfig | Plan | None) -> Prediction:
        resolved = resolve(plan, self.model_sites)
        problems = list(offload_prediction_problems(resolved.layers, resolved.full_recompute))
        if problems:
            raise ConfigError(problems)
        if resolved.offloads() and not self.offload:
            raise ConfigError(
                [
                    Problem(
                        "offload",
                        "this trace did not measure offload; trace with "
                        "offload=True (remat plan --offload) to predict an offload plan",
                    )
                ]
            )
        if resolved.offloads() and resolved.min_offloaded_tensor_size != self.min_offloaded_tensor_size:
            raise ConfigError(
                [
                    Problem(
                        "min_offloaded_tensor_size",
                        (
                            f"the plan offloads storages of {resolved.min_offloaded_tensor_size} elements or more, the trace"
                            f" measured {self.min_offloaded_tensor_size}; trace with the plan's threshold"
                        ),
                    )
                ]
            )
        grouped = {i for s, e in resolved.full_recompute for i in range(s, e)}
        chosen = [
            self.choice(s, e, None, resolved.layers[s].get(LAYER) == "offload") for s, e in resolved.full_recompute
        ]
        chosen += [self.choice(i, i + 1, a) for i, a in enumerate(resolved.layers) if i not in grouped]
        problem = PlanningProblem(self.model_sites.num_layers, chosen, self.windows)
        peak, window = problem.peak_and_window(chosen)
        return Prediction(
            self.baseline_saved_bytes - sum(c.freed_bytes for c in chosen),
            peak,
            self.base_step_time_s + sum(c.added_time_s for c in chosen),
            window,
            sum(c.host_bytes for c in chosen),
        )


def _frees_something(choice: Choice) -> bool:
    return choice.freed_bytes > 0 or any(b < 0 for b in choice.window_bytes.values())


def _no_worse_with_fewer_actions(fewer: Choice, more: Choice) -> bool:
    """`fewer` keeps some of the sites `more` acts on (and does the same elsewhere), and is no
    worse in any window: `more`'s extra actions would only cost time."""
    extra = combo_of(more.actions or {})
    if fewer.actions is None or not combo_of(fewer.actions) < extra:
        return False
    windows = set(fewer.window_bytes) | set(more.window_bytes)
    return (
        fewer.freed_bytes >= more.freed_bytes
        and fewer.host_bytes <= more.host_bytes
        and all(fewer.window_bytes.get(w, 0) <= more.window_bytes.get(w, 0) for w in windows)
    )


def combo_of(actions: Mapping[str, str]) -> Combo:
    """The actions that act: not keep, and not at a site whose enclosing site recomputes (its
    replay runs the inner site plainly)."""
    recomputed = {label for label, action in actions.items() if action == "recompute"}
    return frozenset(
        (label, action)
        for label, action in actions.items()
        if action != "keep" and enclosing().get(label) not in recomputed
    )


def offloads(combo: Combo) -> bool:
    return any(action == "offload" for _, action in combo)


def resolve(plan: RecomputeConfig | Plan | None, model_sites: ModelSites) -> Plan:
    if plan is None:
        return Plan.none(model_sites.num_layers)
    if isinstance(plan, RecomputeConfig):
        check_config(plan, model_sites)
        plan = Plan.from_config(plan, model_sites)
    else:
        check_plan(plan.layers, plan.full_recompute, model_sites)
    return plan


def combos(labels: frozenset[str]) -> list[Combo]:
    """Keep or recompute every label (discard instead where that is all that frees anything);
    discard too where outputs are discarded (layernorm...). Each distinct combination once."""
    ordered = sorted(labels)
    options = [
        ("keep",)
        if label in offload_only_labels()
        else (
            "keep",
            *(() if label in discard_only_labels() else ("recompute",)),
            *(("discard",) if label in discard_labels() else ()),
        )
        for label in ordered
    ]
    return list(dict.fromkeys(combo_of(dict(zip(ordered, choice))) for choice in itertools.product(*options)))


def unmeasured_problems(plan: Plan, model_sites: ModelSites, offload: bool) -> Iterator[Problem]:
    """The layers whose actions a trace (with or without offload) does not measure: known before
    tracing (`estimate` checks every plan first)."""
    grouped = {i for s, e in plan.full_recompute for i in range(s, e)}
    for i, actions in enumerate(plan.layers):
        acting = combo_of(actions)
        measured = combos(model_sites.labels[i]) + (offload_combos(model_sites.labels[i]) if offload else [])
        if i not in grouped and acting not in measured:
            yield _unmeasured(i, acting)


def _unmeasured(layer: int, combo: Combo) -> Problem:
    shown = ", ".join(f"{k}={v}" for k, v in sorted(combo))
    return Problem(
        f"layers[{layer}]",
        f"the trace did not measure {shown}"
        + (
            " (offload in a layer: the trace measures each site offloaded alone, or layer=offload with the other"
            " sites kept, recomputed or discarded)"
            if offloads(combo)
            else ""
        ),
    )


def offload_combos(labels: frozenset[str]) -> list[Combo]:
    """Offload the heavy, recompute the cheap: every combination with the rest of the layer
    offloaded, and each site offloaded alone (which keeps the copies short)."""
    return [c | {OFFLOAD} for c in combos(labels)] + [frozenset({(label, "offload")}) for label in sorted(labels)]


def offload_prediction_problems(
    layers: Sequence[Mapping[str, str]], full_recompute: Sequence[tuple[int, int]]
) -> Iterator[Problem]:
    """Offload the trace cannot price: in the last layer (of a model or pipeline stage), whose
    backward comes right after its forward, nothing hides the copies or prefetches them."""
    last = len(layers) - 1
    ends = {s: e for s, e in full_recompute}
    for i, actions in enumerate(layers):
        if "offload" in actions.values() and ends.get(i, i + 1) - 1 == last:
            yield Problem(
                f"layers[{i}]",
                f"offloads in the last layer ({last}), whose backward comes right after"
                f" its forward: nothing hides the copies; keep it on the GPU (as Megatron"
                f" does) or split the range before it",
            )


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
        for label in [*sorted(trace.model_sites.labels[i]), LAYER]:
            if (i, label) in trace.storages:
                alone = effects.combos.get(
                    frozenset({(label, "discard" if label in discard_only_labels() else "recompute")})
                )
                yield owner_name((i, label)), trace.storages[(i, label)], None if alone is None else alone.freed_bytes
    for owner, storages in trace.storages.items():
        if owner[0] is None:
            yield owner_name(owner), storages, None


def describe(trace: Trace) -> Iterator[tuple[str, int, float, float]]:
    """(combination, bytes freed per layer, ms added per layer, the noise of that in ms) for the
    first layer of each kind. A cost is timed on every layer of its kind at once against the
    no-recompute step, so its noise is both steps' spread over those layers."""
    for _, effects in _first_of_each_kind(trace):
        noise = 2 * trace.step_noise_s * 1e3 / sum(other is effects for other in trace.layers)
        for combo, effect in effects.combos.items():
            yield (
                ", ".join(f"{k}={v}" for k, v in sorted(combo)) or "keep",
                effect.freed_bytes,
                effect.added_time_s * 1e3,
                noise,
            )
        yield "full recompute", effects.groups[1].freed_bytes, effects.layer_time_s * 1e3, noise
        if effects.offloaded_groups:
            offloaded = effects.offloaded_groups[1]
            yield "full recompute, input offloaded", offloaded.freed_bytes, offloaded.added_time_s * 1e3, noise
