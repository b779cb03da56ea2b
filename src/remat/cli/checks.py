"""Checks of command lines: flag combinations, and the files a command will write (before it runs)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from remat.bench import history
from remat.bench.golden import threshold_problems
from remat.config.offload_rules import min_offload_size_problems
from remat.config.recompute import RecomputeConfig
from remat.core.problems import Problem


def recompute_flag_problems(
    recompute_num_layers: int | None, recompute_modules: str | None, recompute_granularity: str | None = None
) -> Iterator[Problem]:
    """Bridge's perf flags: -rl and --recompute_modules each choose the granularity."""
    if recompute_num_layers is not None and recompute_modules is not None:
        yield Problem(
            "-rl/--recompute_modules",
            "pass one of them: -rl N recomputes whole layers, "
            "--recompute_modules recomputes the listed modules in every layer",
        )
    elif recompute_modules is not None and recompute_granularity == "full":
        yield Problem(
            "--recompute_granularity",
            "full recomputes whole layers and --recompute_modules lists modules"
            " for selective recompute; drop --recompute_granularity full (the"
            " modules imply selective), or drop --recompute_modules and pass"
            " -rl N",
        )
    elif recompute_num_layers is not None and recompute_granularity == "selective":
        yield Problem(
            "--recompute_granularity",
            "selective recomputes modules in every layer and -rl N recomputes"
            " N whole layers (full); drop --recompute_granularity selective (-rl"
            " implies full), or drop -rl and pass --recompute_modules",
        )


def plan_file_flag_problems(other_flags: Mapping[str, Any], model_given: bool = True) -> Iterator[Problem]:
    """A per-layer plan file passed with --config, beside the command's other flags."""
    if other_flags:
        yield Problem(
            "--config", "a per-layer plan file sets every action itself; drop the recompute and offload flags"
        )
    if not model_given:
        yield Problem("--config", "a per-layer plan is checked against a model: pass -mr RECIPE")


def configs_flag_problems(flags: RecomputeConfig | None) -> Iterator[Problem]:
    """`remat estimate --configs` estimates the entries it lists: a config the recompute and
    offload flags (or --config) choose beside them would be dropped. `flags` is what they resolve
    to; None for a per-layer plan file."""
    chosen = ["--config (a per-layer plan)"] if flags is None else flags.changed()
    if chosen:
        yield Problem(
            "--configs",
            f"estimates only the entries it lists, so what the flags set ({', '.join(chosen)})"
            " would be ignored; give it as an entry (like mlp+core_attn or full_block_2; "
            "offload in a config or plan file) or drop either the flags or --configs",
        )


def output_path_problems(flag: str, path: str | os.PathLike[str]) -> Iterator[Problem]:
    """A file written once a run is over, checked before it starts (the writers create missing folders)."""
    target = Path(path)
    if target.is_dir():
        yield Problem(flag, f"{path} is a directory; give a file path in it")
        return
    folder = next(p for p in target.absolute().parents if p.exists())  # the nearest that exists
    # tried, not looked up: os.access says yes to root everywhere, read-only mounts included
    if target.exists():
        if (error := _open_error(lambda: target.open("ab"))) is not None:
            yield Problem(flag, f"{path} cannot be overwritten ({error}); choose another path")
        elif target.is_char_device() and (error := _write_error(target)) is not None:
            yield Problem(flag, f"{path} refuses writes ({error}); choose another path")
    elif not folder.is_dir():
        yield Problem(flag, f"{folder} is a file, so {path} cannot be created in it; choose another path")
    elif (error := _open_error(lambda: tempfile.NamedTemporaryFile(dir=folder))) is not None:
        yield Problem(flag, f"{path} cannot be created in {folder} ({error}); choose another folder")


def _write_error(device: Path) -> str | None:
    """Why a byte written to a device fails (/dev/full: no space), or None; a terminal is not tried."""
    try:
        with device.open("ab", buffering=0) as f:
            if not f.isatty():
                f.write(b"\n")
    except OSError as e:
        return e.strerror or str(e)
    return None


def _open_error(opener: Callable[[], IO[bytes]]) -> str | None:
    """Why opening fails (the OS's words), or None when it opens; closed at once."""
    try:
        opener().close()
    except OSError as e:
        return e.strerror or str(e)
    return None


def doctor_flag_problems(
    *, results: bool, state: bool, oom_message: bool, timeline: bool, request: bool, limit: bool
) -> list[Problem]:
    """remat doctor does one thing per call: flags that the chosen one would ignore are refused."""
    problems = []
    if timeline and (results or state):
        problems.append(
            Problem(
                "--timeline",
                "plots a run of the recipe, not a file or message; drop --timeline or"
                " the --results / --snapshot / --oom_message",
            )
        )
    if not state:
        problems += [
            Problem(flag, f"describes an OOM's allocator state, for --snapshot or --oom_message only; drop {flag}")
            for flag, given in (("--request", request), ("--limit", limit))
            if given
        ]
    elif limit and oom_message:
        problems.append(Problem("--limit", "the OOM message gives the device's capacity; drop --limit"))
    elif not limit and not oom_message:
        problems.append(Problem("--limit", "a snapshot records no device size; pass --limit (e.g. 80GiB)"))
    return problems


def one_process_problems(command: str, gpus: int, started: int) -> Iterator[Problem]:
    """remat doctor's run and remat sweep run one process: a run over several GPUs (the flags'
    `gpus`, or the processes torchrun `started`) is remat bench's, which diagnoses an OOM on any
    rank with that rank's numbers."""
    if max(gpus, started) > 1:
        yield Problem(
            command,
            f"runs one process, and this run takes {max(gpus, started)} GPUs (-ng, tp x pp x cp, or"
            " torchrun's processes); `remat bench` with the same flags runs one config on them and"
            " diagnoses an OOM on any rank with that rank's numbers",
        )


def doctor_run_problems(cuda_available: bool) -> Iterator[Problem]:
    """remat doctor -mr runs the bench to catch an OOM, and an OOM is a GPU's."""
    if not cuda_available:
        yield Problem(
            "doctor",
            "without --results, --snapshot, --oom_message or --timeline it runs the bench of a"
            " recipe (-mr) on a CUDA GPU to diagnose an OOM, and this machine has none; pass"
            " --timeline PNG to plot one step's memory (CPU too), or --results, --snapshot or"
            " --oom_message to diagnose a past run",
        )


def tolerance_problems(tolerance: float) -> Iterator[Problem]:
    if not tolerance >= 0:  # NaN too
        yield Problem(
            "tolerance", f"is {tolerance}; use 0 (bit-identical) or the largest gradient difference to accept"
        )


def history_file_problems(path: str | os.PathLike[str]) -> Iterator[Problem]:
    """An existing --history file must be a run history remat can read and write, or the run's
    record is lost at its end: checked before the run."""
    target = Path(path)
    if target.is_file() and target.stat().st_size:  # SQLite starts an empty file itself
        with target.open("rb") as f:
            header = f.read(16)
        try:
            if header != b"SQLite format 3\x00":  # SQLite reads a file shorter than its header as empty
                raise history.HistoryError(f"{path} is not a run history (file is not a database); choose another file")
            history.check(target)
        except history.HistoryError as err:
            yield Problem("--history", str(err))


def history_flag_problems(history: str | None, no_history: bool) -> Iterator[Problem]:
    """Where to record a run, and not to record it."""
    if history and no_history:
        yield Problem("--history", "names a history file and --no_history records none; drop one")


def png_path_problems(flag: str, path: str | os.PathLike[str] | None) -> Iterator[Problem]:
    """remat's plots are PNG files: a name that says otherwise would mislead whoever opens it."""
    if path is not None and Path(path).suffix.lower() != ".png":
        yield Problem(flag, f"{path}: the plot is a PNG; end the name in .png")


def plan_run_flag_problems(verify: bool, given: Iterable[str]) -> Iterator[Problem]:
    """remat plan's run flags (-ms, --warmup_steps, --history) set the --verify run; the trace ignores them."""
    if not verify:
        for flag in given:
            yield Problem(flag, "sets the run --verify makes, and there is none; pass --verify or drop it")


def planning_flag_problems(configs: Sequence[str] | None, recompute_flags: Mapping[str, Any]) -> Iterator[Problem]:
    """--memory-budget asks the planner to choose: not beside configs or recompute flags given
    (`recompute_flags`: the recompute settings a command line gives, by field name)."""
    if configs:
        yield Problem("--configs", "--memory-budget plans instead of estimating given configs; drop one of them")
    for key in recompute_flags:
        if key != "min_offloaded_tensor_size":
            yield Problem(key, "--memory-budget chooses what to recompute or offload; drop the flag")


def per_stage_verify_problems(verify: bool, model_parallel: int) -> Iterator[Problem]:
    """--verify benches the plan in this process; a plan per stage runs on tp x pp x cp processes."""
    if verify and model_parallel > 1:
        yield Problem(
            "--verify",
            f"benches the plan in this one process, and this layout needs {model_parallel};"
            " drop --verify and run the written plan with remat bench --config FILE and the"
            " same layout flags",
        )


def plan_output_problems(flag: str, path: str | os.PathLike[str]) -> Iterator[Problem]:
    """A plan or config file is read back by its suffix (remat bench --config, remat.sites.apply)."""
    if Path(path).suffix.lower() not in (".yaml", ".yml", ".json"):
        yield Problem(flag, f"{path}: a plan is read back by its suffix; end the name in .yaml, .yml or .json")


def dryrun_output_problems(flags: Iterable[str]) -> Iterator[Problem]:
    """Output flags beside -d, which runs nothing and so writes nothing."""
    for flag in flags:
        yield Problem(flag, "a dry run (-d) runs nothing, so nothing is written; drop it or drop -d")


def golden_flag_problems(threshold: float | None, golden_given: bool) -> Iterator[Problem]:
    """--threshold only means something for a golden comparison."""
    if threshold is not None and not golden_given:
        yield Problem(
            "threshold",
            "sets how much a golden comparison may differ, and there is none; pass --golden FILE or drop --threshold",
        )
    elif threshold is not None:
        yield from threshold_problems(threshold)


def offload_device_advice(device: str, offloading: Sequence[str]) -> Iterator[Problem]:
    """Runs that offload, on a device where that saves nothing (advice: the CPU path tests the mechanism)."""
    if offloading and device == "cpu":
        yield Problem(
            "device",
            f"offload on CPU ({', '.join(offloading)}) copies CPU memory to CPU memory: it"
            " exercises the mechanism only, and the lower peak allocated and the peak host it"
            " reports are no saving; measure offload on a GPU",
        )


def offload_threshold_problems(offload: bool, min_offloaded_tensor_size: int | None) -> Iterator[Problem]:
    """remat plan's --min_offloaded_tensor_size: for offload only, and a size."""
    if min_offloaded_tensor_size is None:
        return
    if not offload:
        yield Problem(
            "min_offloaded_tensor_size",
            "sets which tensors offload moves, and offload is off; pass --offload or drop it",
        )
    else:
        yield from min_offload_size_problems(min_offloaded_tensor_size)
