"""Hostile input, round three, run the way it was found: integers past 64 bits, a stdout that
cannot encode '±', `--json -`, bare sizes, a CPU sweep's noise; then random config files and
environments (COLUMNS, REMAT_HISTORY) drawn by hypothesis."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.hostile import TINY_RUN, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import remat
from remat.cli import common
from remat.config.recompute import _KNOWN_KEYS

pytestmark = pytest.mark.usefixtures("private_run_dir")

SECONDS = 10.0
HUGE = "99999999999999999999999"
INT64 = "-9223372036854775808 to 9223372036854775807"
SRC = str(Path(remat.__file__).parents[1])  # the remat under test, for a fresh process


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", *TINY_RUN, "--no_history", "--seed", HUGE],  # as found: "Overflow when unpacking long long"
        ["plan", "--memory-budget", "1GiB", "--max_group", HUGE],
        ["validate", "--tensor_model_parallel_size", f"-{HUGE}"],
        ["history", "show", HUGE],
    ],
)
def test_an_integer_past_64_bits_is_refused_naming_its_flag_and_the_range(capsys, argv) -> None:
    code, _, err, seconds = run(capsys, *argv)
    flag = argv[-2] if argv[0] != "history" else "ID"
    assert code == 2 and f"{flag}: {argv[-1]} is out of range; give a whole number from {INT64}" in err, err
    assert "Traceback" not in err and seconds < SECONDS


@pytest.mark.slow
def test_a_plan_is_written_and_printed_on_an_ascii_stdout(tmp_path) -> None:
    """As found: PYTHONIOENCODING=ascii died on the trace table's '±' before writing the plan."""
    argv = [sys.executable, "-m", "remat", "plan", "-mr", "llama3_tiny", "--num_layers", "2", "-sl", "16"]
    argv += ["--memory-budget", "2.2MiB", "-o", "plan.yaml", "--no_progress", "--no_history"]
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "PYTHONPATH": SRC}
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "written to plan.yaml" in done.stdout
    assert "remat_plan" in (tmp_path / "plan.yaml").read_text() or (tmp_path / "plan.yaml").stat().st_size


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["estimate", "-mr", "llama3_tiny", "--target", "cpu", "--no_progress"],
        ["bench", *TINY_RUN, "--no_history"],
        ["sweep", *TINY_RUN, "--configs", "none", "--no_history"],
    ],
)
def test_json_dash_is_stdout_holding_the_json_alone(capsys, tmp_path, argv) -> None:
    code, out, err, _ = run(capsys, *argv, "--json", "-")
    assert code == 0, err
    assert json.loads(out) and "llama3_tiny" in err  # the tables went to stderr
    assert not (tmp_path / "-").exists()


def test_a_cpu_sweep_says_its_step_times_are_noisy(capsys) -> None:
    code, out, err, _ = run(capsys, "sweep", *TINY_RUN, "--configs", "none", "--no_history")
    assert code == 0, err
    assert "step time on CPU: one process runs tens of percent faster than another, and more under load" in out


def test_a_bare_size_is_bytes_to_every_size_flag(capsys) -> None:
    """--memory-budget read a bare 2.5 as GiB, doctor's --request as bytes: now both say bytes."""
    message = "'2.5' is not a whole number of bytes (a bare number is bytes); give a unit, like 2.5GiB"
    code, _, err, _ = run(capsys, "plan", "-mr", "llama3_tiny", "--memory-budget", "2.5", "--no_progress")
    assert code == 1 and f"memory_budget: {message}" in err, err
    oom = "CUDA out of memory. Tried to allocate 2.00 GiB"
    code, _, err, _ = run(capsys, "doctor", "--oom_message", oom, "--request", "2.5")
    assert code == 1 and f"request: {message}" in err, err
    code, _, err, _ = run(capsys, "plan", "-mr", "llama3_tiny", "--memory-budget", "400000", "--no_progress")
    assert code == 1 and "the 0.38 MiB budget" in err, err  # 400000 bytes, not GiB
    for command in ("plan", "doctor", "estimate"):
        assert "a bare number is bytes" in run(capsys, command, "-h")[1].replace("\n", " ")


# ---- random config files and environments ---------------------------------------------------

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, 1, 2, 4, -1, 10**30, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["full", "selective", "uniform", "block", "core_attn,mlp", "±∞", "\x00", "1e400"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
KEYS = st.sampled_from(sorted(_KNOWN_KEYS)) | st.sampled_from(["remat_plan", "layers", "model"]) | st.text(max_size=10)


@st.composite
def config_texts(draw: Any) -> bytes:
    """YAML or JSON of known and unknown keys, nested values, aliases; or bytes at random."""
    kind = draw(st.sampled_from(["yaml", "json", "alias", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    mapping = draw(st.dictionaries(KEYS, VALUES, max_size=5))
    if kind == "json":
        return json.dumps(mapping, allow_nan=True).encode()
    text = yaml.safe_dump(mapping, allow_unicode=True)
    if kind == "alias":
        key = draw(st.sampled_from(sorted(_KNOWN_KEYS)))
        text = f"base: &b {draw(st.sampled_from(['[mlp, mlp]', '{x: 1}', '7', 'full']))}\n{key}: *b\n{text}"
    return text.encode()


ENVIRONMENTS = st.fixed_dictionaries(
    {
        "COLUMNS": st.one_of(st.none(), st.sampled_from(["0", "-5", "5", "abc", "", "99999999999999999999"])),
        "REMAT_HISTORY": st.sampled_from(["dir", "file", "missing/deep/h.sqlite", "garbage", "/dev/null", "/proc/x"]),
    }
)


def _environment(env: dict[str, str | None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """COLUMNS as a fresh process reads it (the consoles are made at import), REMAT_HISTORY set."""
    if env["COLUMNS"] is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", env["COLUMNS"])
    for console, stderr in ((common.out, False), (common.err, True)):
        fresh = common._console(stderr)
        monkeypatch.setattr(console, "width", fresh.width)
        monkeypatch.setattr(console, "soft_wrap", fresh.soft_wrap)
    history = {"dir": tmp_path, "file": tmp_path / "h.sqlite", "garbage": tmp_path / "garbage.sqlite"}
    (tmp_path / "garbage.sqlite").write_bytes(b"not sqlite\x00\xff" * 10)
    monkeypatch.setenv("REMAT_HISTORY", str(history.get(env["REMAT_HISTORY"], env["REMAT_HISTORY"])))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=config_texts(), env=ENVIRONMENTS, suffix=st.sampled_from([".yaml", ".json", ".yml", ""]))
def test_random_config_files_and_environments_get_an_answer_never_a_traceback(
    capsys, tmp_path, monkeypatch, config, env, suffix
) -> None:
    with monkeypatch.context() as patched:
        _environment(env, tmp_path, patched)
        path = tmp_path / f"config{suffix}"
        path.write_bytes(config)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for argv in (["validate", "-mr", "llama3_tiny", "--config", str(path)], ["history"]):
            start = time.perf_counter()
            code, out, err, _ = run(capsys, *argv)
            assert code in (0, 1, 2), (argv, config, env, out, err)
            assert (out or err) and "Traceback" not in out + err, (argv, config, env)
            assert time.perf_counter() - start < SECONDS, (argv, config)
        grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
        assert grown_kib < 2**20, (config, grown_kib)  # under 1 GiB
