"""The caching allocator's state at a failure: captured on the GPU, read from a memory snapshot, or
read from the text of a CUDA out-of-memory message (one process's, or each rank's in a torchrun log)."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from remat.core.problems import ConfigError, Problem, read_file
from remat.core.sizes import format_bytes

# Requests above this go to the large pool; the small pool's holes (<= 1 MiB blocks) cannot serve them.
SMALL_POOL_MAX = 1 << 20


# --- what a failure captures -----------------------------------------------------------------------


@dataclass(frozen=True)
class AllocatorState:
    """The caching allocator at a failure (or on request): bytes allocated and reserved, the limit,
    the failed request, and how the free bytes inside reserved segments are split."""

    allocated: int
    reserved: int
    limit: int  # device memory, or its per-process fraction
    request: int | None = None
    largest_free_block: int | None = None  # None: not known (an OOM message alone)
    segments: int = 0
    free_blocks: int = 0
    device_free: int | None = None  # free on the device (cudaMemGetInfo): other processes count
    expandable: bool = False  # segments already grow (expandable_segments is on)

    @property
    def gap(self) -> int:
        """Reserved but unallocated: cached holes inside this process's segments."""
        return max(self.reserved - self.allocated, 0)

    @property
    def headroom(self) -> int:
        """What the allocator could still reserve: up to the limit, and no more than the device has free."""
        room = max(self.limit - self.reserved, 0)
        return room if self.device_free is None else min(room, self.device_free)

    @property
    def available(self) -> int:
        """The most this allocator can hold: what it reserved plus what it could still reserve."""
        return self.reserved + self.headroom

    @classmethod
    def from_snapshot(
        cls,
        snapshot: Mapping[str, Any],
        stats: Mapping[str, Any],
        limit: int,
        request: int | None = None,
        *,
        device: int | None = None,
        device_free: int | None = None,
    ) -> AllocatorState:
        """From `torch.cuda.memory._snapshot()` (or a pickle/JSON of it) and `memory_stats()` (may be
        empty: the blocks are counted instead)."""
        segments = [s for s in snapshot.get("segments", []) if device is None or s.get("device", device) == device]
        blocks = [b for s in segments for b in s.get("blocks", [])]
        allocated = stats.get(
            "allocated_bytes.all.current", sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        )
        reserved = stats.get("reserved_bytes.all.current", sum(s["total_size"] for s in segments))
        # Private pools (CUDA graphs) and, for a large request, the small pool cannot serve the request.
        serving = [
            s
            for s in segments
            if _default_pool(s) and not (s.get("segment_type") == "small" and (request or 0) > SMALL_POOL_MAX)
        ]
        holes = [run for s in serving for run in _free_runs(s.get("blocks", []))]
        return cls(
            allocated=allocated,
            reserved=reserved,
            limit=limit,
            request=request,
            largest_free_block=max(holes, default=0),
            segments=len(segments),
            free_blocks=sum(1 for s in segments for _ in _free_runs(s.get("blocks", []))),
            device_free=device_free,
            expandable=any(s.get("is_expandable") for s in segments),
        )

    @classmethod
    def from_oom_message(cls, message: str) -> AllocatorState:
        """From the text of a CUDA OOM error alone (a log line): no block sizes, but the allocation failed,
        so no free block held the request."""
        oom = parse_oom_message(message)
        if oom.limit is None or oom.allocated is None or oom.reserved is None:
            raise ValueError(
                "the message does not give the device capacity, allocated and reserved bytes; "
                "pass a snapshot (torch.cuda.memory._dump_snapshot) instead"
            )
        return cls(
            allocated=oom.allocated, reserved=oom.reserved, limit=oom.limit, request=oom.request, device_free=oom.free
        )


def _default_pool(segment: Mapping[str, Any]) -> bool:
    return tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0)


def _free_runs(blocks: Iterable[Mapping[str, Any]]) -> Iterator[int]:
    """Sizes of contiguous free ("inactive") runs of blocks, in address order within one segment."""
    run = 0
    for block in blocks:
        if block["state"] == "inactive":
            run += block["size"]
        elif run:
            yield run
            run = 0
    if run:
        yield run


def capture(device: torch.device | int | str | None = None, request_bytes: int | None = None) -> AllocatorState:
    """The allocator's state now on a CUDA device; RuntimeError without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: there is no allocator state to capture")
    chosen = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    index = torch.cuda.current_device() if chosen.index is None else chosen.index
    free, total = torch.cuda.mem_get_info(index)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(index)  # newer torch only
    return AllocatorState.from_snapshot(
        torch.cuda.memory._snapshot(),
        torch.cuda.memory_stats(index),
        int(total * fraction),
        request_bytes,
        device=index,
        device_free=free,
    )


def oom_state(error: BaseException, device: torch.device | int | str | None = None) -> AllocatorState | None:
    """The allocator at an OOM: captured on `device` (by default this process's GPU, a rank's own
    under torchrun) where CUDA is, else the numbers of the error's message; None when neither has them."""
    message = str(error)
    oom = parse_oom_message(message)
    try:
        state = capture(device, oom.request)
    except RuntimeError:
        try:
            state = AllocatorState.from_oom_message(message)
        except ValueError:
            return None
    if oom.allowed is not None and oom.allowed < state.limit:  # older torch cannot read the fraction back
        state = dataclasses.replace(state, limit=oom.allowed)
    return state


# A memory snapshot of a long run with stack traces is hundreds of megabytes.
MAX_SNAPSHOT_BYTES = 2**31


class _DataUnpickler(pickle.Unpickler):
    """Plain data only: a snapshot is dicts, lists, strings and numbers; a pickle that names any
    class or function (which loading would call) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}; a memory snapshot holds plain data only")


def _data_pickle(raw: bytes) -> Any:
    return _DataUnpickler(io.BytesIO(raw)).load()


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """A snapshot written by `torch.cuda.memory._dump_snapshot` (a pickle of plain data) or as JSON."""
    p = Path(path)
    json_file = p.suffix.lower() == ".json"
    snapshot = read_file(
        p, json.loads if json_file else _data_pickle, "JSON" if json_file else "pickle", MAX_SNAPSHOT_BYTES
    )
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("segments"), list):
        raise ConfigError(
            [
                Problem(
                    str(p),
                    "is not a memory snapshot (no 'segments' list); write one with torch.cuda.memory._dump_snapshot",
                )
            ]
        )
    if (flaw := _segments_flaw(snapshot["segments"])) is not None:
        raise ConfigError(
            [Problem(str(p), f"is not a memory snapshot ({flaw}); write one with torch.cuda.memory._dump_snapshot")]
        )
    return snapshot


def _segments_flaw(segments: list[Any]) -> str | None:
    """The first place where `segments` lacks what classifying reads, or None."""
    for i, segment in enumerate(segments):
        where = f"segments[{i}]"
        if not isinstance(segment, dict) or not isinstance(segment.get("total_size"), int):
            return f"{where} has no integer 'total_size'"
        blocks = segment.get("blocks", [])
        if not isinstance(blocks, list):
            return f"{where}.blocks is not a list"
        for j, block in enumerate(blocks):
            if not (
                isinstance(block, dict) and isinstance(block.get("size"), int) and isinstance(block.get("state"), str)
            ):
                return f"{where}.blocks[{j}] has no integer 'size' and 'state' name"
    return None


def snapshot_limit_problems(reserved: int, limit: int) -> Iterator[Problem]:
    """A memory snapshot records no device size; the one given must hold what the snapshot reserves."""
    if limit < reserved:
        yield Problem(
            "limit",
            f"{format_bytes(limit)} is less than the {format_bytes(reserved)} the snapshot"
            " reserves; pass the device's memory (e.g. --limit 80GiB, or 141GiB on an H200)"
            " or the per-process fraction's share of it",
        )


# --- the OOM message ------------------------------------------------------------------------------

_SIZE = r"([0-9]+(?:\.[0-9]+)?) (bytes|KiB|MiB|GiB|TiB)"
_UNIT = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# Each field as torch >= 2.1 writes it, then as torch < 2.1 did ("(GPU 0; 79.15 GiB total capacity; ...)").
_FIELDS = {
    "request": (rf"Tried to allocate {_SIZE}",),
    "capacity": (rf"total capacity of {_SIZE}", rf"{_SIZE} total capacity"),
    "free": (rf"of which {_SIZE} is free", rf"{_SIZE} free"),
    "allowed": (rf"{_SIZE} allowed",),  # set_per_process_memory_fraction
    "allocated": (rf"{_SIZE} is allocated by PyTorch", rf"{_SIZE} already allocated"),
    "unallocated": (rf"{_SIZE} is reserved by PyTorch but unallocated",),
    "reserved": (rf"{_SIZE} reserved in total by PyTorch",),
}


@dataclass(frozen=True)
class OomMessage:
    """The numbers of a CUDA out-of-memory message (to the message's two decimals); None: not given."""

    request: int | None
    capacity: int | None
    free: int | None
    allowed: int | None = None
    allocated: int | None = None
    reserved: int | None = None

    @property
    def limit(self) -> int | None:
        return self.allowed if self.allowed is not None else self.capacity


def parse_oom_message(message: str) -> OomMessage:
    """Read 'CUDA out of memory. Tried to allocate 2.00 GiB ...' in the formats of torch 1.x-2.0 and 2.1+."""
    found: dict[str, int | None] = {}
    for name, patterns in _FIELDS.items():
        match = next(filter(None, (re.search(p, message) for p in patterns)), None)
        found[name] = round(float(match.group(1)) * _UNIT[match.group(2)]) if match else None
    unallocated = found.pop("unallocated")
    if found["reserved"] is None and found["allocated"] is not None and unallocated is not None:
        found["reserved"] = found["allocated"] + unallocated  # torch >= 2.1 gives the split, not the sum
    return OomMessage(**found)


_RANK_LINE = re.compile(r"^\[rank(\d+)\]: ?(.*)$")


def oom_messages(text: str) -> dict[int | None, str]:
    """Each rank's out-of-memory message in a torchrun log, whose ranks' lines start `[rankN]:`, by
    rank; {None: text} for the message of one process (or a log where no rank's lines say one)."""
    lines: dict[int, list[str]] = {}
    for line in text.splitlines():
        if match := _RANK_LINE.match(line):
            lines.setdefault(int(match[1]), []).append(match[2])
    said = {rank: "\n".join(body) for rank, body in sorted(lines.items())}
    return {rank: message for rank, message in said.items() if "out of memory" in message} or {None: text}
