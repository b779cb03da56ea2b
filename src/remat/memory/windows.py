"""The window model of a step's memory: what the trace measures, the prediction sums and the
planner optimizes over.

A step is cut into windows (each layer's forward and backward, the loss head, the tail of
backward, the optimizer step), each with its own peak. A choice runs a range of layers one way:
a single layer with some site actions, or a range recomputed whole. Every layer is covered by
exactly one choice. A window's peak is its no-recompute peak, plus what the choices covering its
layer add in it, minus what every choice whose saved tensors it still holds frees. The step's
peak is the largest window; its time is the no-recompute step's plus what the choices add.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Window:
    """A stretch of the step with its own peak: `layer`'s forward or backward (None for the loss
    head, the tail of backward, the optimizer step), in which layers [0, holds) keep their saved
    tensors; `base_bytes` is its peak allocated when every layer keeps everything."""

    name: str
    layer: int | None
    holds: int
    base_bytes: int


@dataclass(frozen=True)
class Choice:
    """Run layers [start, end) one way: `actions` for a single layer, or None to recompute the
    range whole (with `input_offloaded`, the input it keeps goes to host). `freed_bytes` is what
    it leaves unsaved after the forward against keeping everything; `window_bytes` what it adds
    to the peaks of the windows it was measured in, by name (its own layers', and for offload the
    next layer's, while copies run); `host_bytes` what it moves to host memory."""

    start: int
    end: int
    actions: dict[str, str] | None
    freed_bytes: int
    added_time_s: float
    window_bytes: Mapping[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    input_offloaded: bool = False

    def delta(self, window: Window) -> int:
        """Bytes this choice adds to (or, negative, removes from) the window's peak: as measured
        in its own windows; elsewhere, what it frees wherever its layers' saved tensors are held."""
        if window.name in self.window_bytes:
            return self.window_bytes[window.name]
        if window.layer is not None and self.start <= window.layer < self.end:
            return 0
        return -self.freed_bytes if self.end <= window.holds else 0


@dataclass(frozen=True)
class PlanningProblem:
    """Choices for every layer over a step's windows: what the planner solves; for the choices of
    one plan, its peak."""

    num_layers: int
    choices: Sequence[Choice]
    windows: Sequence[Window]
    fixed_bytes: int | None = None  # what the micro-batch does not scale (weights, grads, optimizer state), if known
    # A pipeline stage under 1F1B: every window also holds `held_bytes` (what the other micro-batches
    # in flight save when every layer keeps everything, and the stage's inputs), of which each
    # choice frees `others_in_flight` times what it frees in one micro-batch.
    held_bytes: float = 0.0
    others_in_flight: float = 0.0

    def delta(self, choice: Choice, window: Window) -> float:
        """What `choice` adds to the window's peak, the other micro-batches in flight included."""
        return choice.delta(window) - self.others_in_flight * choice.freed_bytes

    def peak_and_window(self, chosen: Sequence[Choice]) -> tuple[int, str]:
        peaks = [
            (round(w.base_bytes + self.held_bytes + sum(self.delta(c, w) for c in chosen)), w.name)
            for w in self.windows
        ]
        return max(peaks)

    def peak(self, chosen: Sequence[Choice]) -> int:
        return self.peak_and_window(chosen)[0]
