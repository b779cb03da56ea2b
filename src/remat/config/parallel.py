"""ParallelLayout: how one training run spreads over GPUs, the one owner of its sizes.

A layout is Megatron's sizes (tensor with sequence parallelism, pipeline with virtual stages,
context, expert) and the GPUs in all, under short names that stay the same from the flag (`-tp`,
spelled `--tensor_model_parallel_size` as Megatron does) to the device mesh's dimensions and a
rank's coordinates. It owns what follows from the sizes alone: its checks, the mesh, where a rank
sits on it, which layers each pipeline stage holds, and its pipeline schedule's arithmetic (the
micro-batches a stage holds at its peak, the fill and drain of a step).

A pipeline schedule is one entry of SCHEDULES here and the torch class that runs it
(`remat.parallel.pipeline`); nothing else names one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from remat.config.fields import (
    from_public,
    optional,
    parse_bool,
    parse_int,
    parse_settings,
    parse_str,
    public_name,
    setting,
    settings,
    to_public,
)
from remat.core.problems import Problem, count, did_you_mean, one_of

# The largest parallel size or layer count the checks take: past any run, and safe to multiply.
MAX_SIZE = 1 << 20
# Mesh dimensions, outermost first (torchtitan's order): a pipeline's stages are the farthest
# apart, tensor-parallel ranks the closest (one NVLink domain).
MESH_DIMS = ("pp", "dp", "cp", "tp")


class Coordinates(NamedTuple):
    """A rank's place on the mesh, by its dimensions' names."""

    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule's arithmetic, as Megatron and torch run it.

    in_flight(layout, pipeline rank, micro-batches): micro-batches whose activations that rank
    holds at its peak (a fraction with virtual stages: model chunks / chunks per rank).
    micro_batch_problems(layout, micro-batches): what the schedule cannot run with that many.
    """

    virtual: bool  # runs several model chunks per rank (needs -vp > 1)
    in_flight: Callable[[ParallelLayout, int, int], float]
    micro_batch_problems: Callable[[ParallelLayout, int], Iterator[Problem]]


def _one_f_one_b_in_flight(layout: ParallelLayout, rank: int, micro_batches: int) -> float:
    """Megatron's warm-up count plus the one in steady state."""
    return float(min(layout.pp - rank, micro_batches))


def _interleaved_in_flight(layout: ParallelLayout, rank: int, micro_batches: int) -> float:
    """Megatron's interleaved warm-up, in model chunks."""
    pp, v = layout.pp, layout.virtual
    chunks = min((pp - rank - 1) * 2 + (v - 1) * pp + 1, micro_batches * v)
    return chunks / v


def _one_f_one_b_problems(layout: ParallelLayout, micro_batches: int) -> Iterator[Problem]:
    if layout.pp > 1 and micro_batches < layout.pp:
        yield Problem(
            "global_batch_size",
            f"gives {micro_batches} micro-batch(es) a step; 1F1B over"
            f" {layout.pp} stages needs at least {layout.pp}: raise -gb",
        )


def _interleaved_problems(layout: ParallelLayout, micro_batches: int) -> Iterator[Problem]:
    yield from _one_f_one_b_problems(layout, micro_batches)
    if micro_batches >= layout.pp and micro_batches % layout.pp:
        yield Problem(
            "global_batch_size",
            f"gives {micro_batches} micro-batches a step; interleaved 1F1B"
            f" runs them in rounds of pp = {layout.pp}: use a multiple",
        )


SCHEDULES: dict[str, Schedule] = {
    "1f1b": Schedule(False, _one_f_one_b_in_flight, _one_f_one_b_problems),
    "interleaved_1f1b": Schedule(True, _interleaved_in_flight, _interleaved_problems),
}


def _size(public: str, short: str, help: str, default: int | None = 1) -> Any:
    """A size flag: `short` or Megatron's `--public`; None as the default means unset."""
    parse = parse_int if default is not None else optional(parse_int)
    return setting(default, parse=parse, public=public, flag=True, short=short, metavar="N", help=help)


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron's parallel sizes and the GPUs in all. Not checked on creation: `problems()` says
    what is wrong, so that an owner reports it beside its own problems."""

    tp: int = _size(
        "tensor_model_parallel_size",
        "-tp",
        "tensor-parallel ranks (with --sequence_parallel, the tokens between attention and MLP split too)",
    )
    sp: bool = setting(
        False,
        parse=parse_bool,
        public="sequence_parallel",
        flag=True,
        help="split the tokens outside attention and MLP over the tensor-parallel ranks",
    )
    pp: int = _size("pipeline_model_parallel_size", "-pp", "pipeline stages")
    vp: int | None = _size(
        "virtual_pipeline_model_parallel_size", "-vp", "model chunks per pipeline rank (interleaved 1F1B)", None
    )
    cp: int = _size(
        "context_parallel_size",
        "-cp",
        "context-parallel ranks: each holds a share of every sequence, attention runs as torch's ring",
    )
    ep: int = _size(
        "expert_model_parallel_size",
        "-ep",
        "MoE models: each MoE layer's routed experts split over N data-parallel ranks, tokens sent"
        " to their experts' ranks by all-to-all",
    )
    etp: int | None = _size(
        "expert_tensor_parallel_size",
        "-etp",
        "MoE models: each expert's FFN split over N ranks (beside -tp, Megatron's default: the tensor-parallel ranks)",
        None,
    )
    num_gpus: int | None = _size(
        "num_gpus",
        "-ng",
        "GPUs in all: tp x pp x cp x data parallel (default: one copy of the model, tp x pp x cp)",
        None,
    )
    schedule: str | None = setting(
        None,
        parse=optional(parse_str),
        public="pipeline_parallel_schedule",
        flag=True,
        choices=tuple(SCHEDULES),
        metavar="NAME",
        help="the pipeline schedule (default: 1f1b, interleaved_1f1b with -vp)",
    )

    # ---- sizes -----------------------------------------------------------------------------

    @property
    def virtual(self) -> int:
        """Model chunks per pipeline rank (vp, 1 when unset)."""
        return self.vp or 1

    @property
    def chunks(self) -> int:
        """Model chunks over the whole pipeline: pp x vp."""
        return self.pp * self.virtual

    @property
    def model_parallel(self) -> int:
        """GPUs one copy of the model spans: tp x pp x cp (at least 1)."""
        return max(self.tp * self.pp * self.cp, 1)

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the GPUs over tp x pp x cp (1 without num_gpus)."""
        return 1 if self.num_gpus is None else max(self.num_gpus // self.model_parallel, 1)

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights, over which FSDP2 shards them and reduces gradients: dp x cp."""
        return self.dp * self.cp

    @property
    def gpus(self) -> int:
        """The GPUs the run takes: num_gpus, else one copy of the model."""
        return self.num_gpus or self.model_parallel

    @property
    def sequence_split(self) -> int:
        """How many ways sequence parallelism splits the tokens outside attention and MLP."""
        return self.tp if self.sp and self.tp > 1 else 1

    @property
    def pipeline_schedule(self) -> str:
        """The schedule's name: the one given, else Megatron's (interleaved with virtual stages)."""
        return self.schedule or ("interleaved_1f1b" if self.virtual > 1 else "1f1b")

    # ---- the mesh ----------------------------------------------------------------------------

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """The sizes of MESH_DIMS."""
        return self.pp, self.dp, self.cp, self.tp

    def coordinates(self, rank: int) -> Coordinates:
        """Where global rank `rank` sits on the pp x dp x cp x tp mesh (`mesh()` lays it out so)."""
        dp, cp, tp = self.dp, self.cp, self.tp
        return Coordinates(rank // (dp * cp * tp), rank // (cp * tp) % dp, rank // tp % cp, rank % tp)

    def mesh(self, device: str) -> Any:
        """The pp x dp x cp x tp device mesh over every rank of the default process group."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device.split(":")[0], self.mesh_shape, mesh_dim_names=MESH_DIMS)

    # ---- pipeline stages ------------------------------------------------------------------------

    def layers_per_chunk(self, num_layers: int | None) -> int | None:
        """Layers in one model chunk; None when unknown or when the layers do not split evenly."""
        if num_layers is None or num_layers < 1 or self.chunks < 1 or num_layers % self.chunks:
            return None
        return num_layers // self.chunks

    def stage_indices(self, pipeline_rank: int) -> list[int]:
        """The model chunks (stages), first to last, that pipeline rank `pipeline_rank` runs:
        rank, rank + pp, rank + 2 pp, ... as Megatron and torch order them."""
        return [pipeline_rank + k * self.pp for k in range(self.virtual)]

    def chunk_layers(self, num_layers: int, chunk: int) -> range:
        """The model's layers model chunk `chunk` holds (an equal share each)."""
        per_chunk = num_layers // self.chunks
        return range(chunk * per_chunk, (chunk + 1) * per_chunk)

    def rank_layers(self, num_layers: int, pipeline_rank: int) -> tuple[int, ...]:
        """The model's layers pipeline rank `pipeline_rank` runs: its chunks' back to back."""
        return tuple(i for chunk in self.stage_indices(pipeline_rank) for i in self.chunk_layers(num_layers, chunk))

    def in_flight(self, pipeline_rank: int, micro_batches: int) -> float:
        """Micro-batches whose activations pipeline rank `pipeline_rank` holds at its peak."""
        return SCHEDULES[self.pipeline_schedule].in_flight(self, pipeline_rank, micro_batches)

    def step_time(self, stage_times: Sequence[float], micro_batches: int) -> float:
        """A step's time from each pipeline rank's time per micro-batch: the steady state runs the
        micro-batches at the pace of the slowest, and filling and draining the pipeline passes
        once through the others (in 1/vp steps with virtual stages)."""
        slowest = max(stage_times)
        return micro_batches * slowest + (sum(stage_times) - slowest) / self.virtual

    # ---- checks -----------------------------------------------------------------------------

    def problems(self, num_layers: int | None = None) -> Iterator[Problem]:
        """What is wrong with the sizes (and with them for a model of `num_layers`), each problem
        under Megatron's name of the size to change."""
        values, type_problems = parse_settings(self)
        yield from type_problems
        if type_problems:
            return
        for f, _ in settings(self):
            size = values[f.name]
            if f.name != "num_gpus" and isinstance(size, int) and not isinstance(size, bool):
                yield from _size_problems(public_name(f), size)
        if num_layers is not None:
            yield from _size_problems("num_layers", num_layers)
        yield from self.gpu_problems()
        yield from self._pipeline_problems(num_layers)
        yield from self.expert_problems()

    def _pipeline_problems(self, num_layers: int | None) -> Iterator[Problem]:
        if self.vp is not None and self.pp == 1:
            yield Problem(
                "virtual_pipeline_model_parallel_size",
                "virtual pipeline stages need"
                " pipeline_model_parallel_size > 1; set it to"
                " null or raise the pipeline size",
            )
        stages = self.chunks
        if num_layers is not None and num_layers >= 1 and stages >= 1 and num_layers % stages:
            yield Problem(
                "num_layers",
                f"{count(num_layers, 'layer')} {'does' if num_layers == 1 else 'do'} not"
                f" split evenly into {stages} (virtual) pipeline stages; use a multiple"
                f" of {stages} or change the pipeline sizes",
            )
        schedule = SCHEDULES.get(self.pipeline_schedule)
        if schedule is None:
            yield Problem(
                "pipeline_parallel_schedule",
                f"{self.schedule!r} is not a schedule"
                f"{did_you_mean(str(self.schedule), SCHEDULES)}; use one"
                f" of {one_of(tuple(SCHEDULES))}",
            )
        elif schedule.virtual != (self.virtual > 1):
            need = "needs virtual stages (-vp 2 or more)" if schedule.virtual else "runs one model chunk per rank"
            yield Problem("pipeline_parallel_schedule", f"{self.pipeline_schedule} {need}; change -vp or the schedule")

    def expert_problems(self) -> Iterator[Problem]:
        """Expert-parallel ranks are data-parallel ranks that split the experts: ep divides dp."""
        if self.ep > 1 and self.num_gpus is not None and self.num_gpus % self.model_parallel == 0 and self.dp % self.ep:
            yield Problem(
                "expert_model_parallel_size",
                f"({self.ep}) does not divide the {self.dp} data-parallel"
                f" rank(s) ({self.num_gpus} GPUs / tp x pp x cp"
                f" {self.model_parallel}); expert-parallel ranks are"
                " data-parallel ranks that split the experts: use a"
                f" multiple of {self.model_parallel * self.ep} GPUs",
            )

    def gpu_problems(self) -> Iterator[Problem]:
        """num_gpus against the model-parallel sizes."""
        if self.num_gpus is None:
            return
        if self.num_gpus > MAX_SIZE:
            yield Problem("num_gpus", f"is {self.num_gpus:,}; remat plans for at most {MAX_SIZE:,} GPUs")
        elif self.num_gpus < 1:
            yield Problem("num_gpus", f"is {self.num_gpus}; use at least {self.model_parallel} (tp x pp x cp)")
        elif self.num_gpus % self.model_parallel:
            verb = "does" if self.num_gpus == 1 else "do"
            yield Problem(
                "num_gpus",
                f"{count(self.num_gpus, 'GPU')} {verb} not split into data-parallel groups"
                f" of tp x pp x cp = {self.model_parallel}; use a multiple of"
                f" {self.model_parallel}",
            )

    def schedule_problems(self, micro_batches: int) -> Iterator[Problem]:
        """What the pipeline schedule cannot run with this many micro-batches a step."""
        schedule = SCHEDULES.get(self.pipeline_schedule)
        if schedule is not None and self.pp > 1:
            yield from schedule.micro_batch_problems(self, micro_batches)

    def advice(self) -> Iterator[Problem]:
        """Sizes that run but do nothing."""
        if self.sp and self.tp == 1:
            yield Problem(
                "sequence_parallel",
                "has no effect with tensor_model_parallel_size 1 (Megatron turns it"
                " off); raise tensor_model_parallel_size or drop sequence_parallel",
            )

    # ---- Megatron's keys --------------------------------------------------------------------

    @classmethod
    def from_megatron(cls, keys: Mapping[str, Any]) -> ParallelLayout:
        """The layout among Megatron's keys (others ignored)."""
        return cls(**from_public(cls, keys))

    def to_megatron(self) -> dict[str, Any]:
        return to_public(self)

    def describe(self) -> str:
        vp = self.vp or "-"
        sp = "on" if self.sp and self.tp > 1 else "off"
        return f"parallel: TP {self.tp}, PP {self.pp}, VPP {vp}, CP {self.cp}, sequence parallel {sp}"


def _size_problems(name: str, size: int) -> Iterator[Problem]:
    if size < 1:
        yield Problem(name, f"got {size}; set it to 1 or more")
    elif size > MAX_SIZE:
        yield Problem(name, f"got {size:,}; remat checks sizes up to {MAX_SIZE:,} (a million GPUs or layers)")
