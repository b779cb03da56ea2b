"""Hostile input, round two, run the way it was found: a YAML alias bomb, a file of tens of
megabytes, thousands of problems, a pickle that would run code, a config.json without a model,
COLUMNS=0, Ctrl-C in a command and in a sweep."""

from __future__ import annotations

import pickle
import resource

import pytest
import yaml
from helpers.hostile import run

from remat.core.problems import MAX_FILE_BYTES, SHOWN_PROBLEMS, safe_yaml

TINY_SWEEP = [
    "-mr",
    "llama3_tiny",
    "--num_layers",
    "2",
    "-sl",
    "16",
    "-ms",
    "4",
    "--warmup_steps",
    "1",
    "--no_progress",
]


def _bomb(depth: int = 9) -> str:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefghij", "bcdefghij"[: depth - 1]):
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    return "\n".join([*lines, f"recompute_modules: *{'abcdefghij'[depth - 1]}"]) + "\n"


def test_a_yaml_alias_bomb_is_refused_in_seconds_and_megabytes(capsys, tmp_path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code, _, err, seconds = run(capsys, "validate", "-mr", "llama3_tiny", "--config", str(path))
    assert code == 1 and "aliases expand it to 926,177,115 nodes, more than 1,000,000" in err
    assert seconds < 5 and len(err) < 500
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: under 200 MB more


def test_aliases_and_merges_that_expand_little_are_read() -> None:
    text = "base: &b {recompute_granularity: selective}\nrun:\n  <<: *b\n  recompute_modules: &m [mlp]\nalso: *m\n"
    assert safe_yaml(text) == yaml.safe_load(text)
    assert safe_yaml(_bomb(depth=5)) == yaml.safe_load(_bomb(depth=5))  # 9**6 strings and lists: under the cap


def test_a_file_larger_than_any_config_is_refused_unread(capsys, tmp_path) -> None:
    path = tmp_path / "huge.yaml"
    with path.open("w") as f:
        f.write("recompute_granularity: selective\n")
        f.write("# padding\n" * (MAX_FILE_BYTES // 10 + 1))
    code, _, err, seconds = run(capsys, "validate", "-mr", "llama3_tiny", "--config", str(path))
    assert code == 1 and "huge.yaml: is over 4 MiB, larger than any YAML file remat reads" in err
    assert seconds < 5


def test_thousands_of_problems_print_the_first_and_count_the_rest(capsys, tmp_path) -> None:
    path = tmp_path / "unknown.yaml"
    path.write_text("".join(f"unknown_key_{i}: 1\n" for i in range(2000)))
    code, _, err, _ = run(capsys, "validate", "-mr", "llama3_tiny", "--config", str(path))
    assert code == 1 and "invalid config (2,000 problems)" in err
    assert err.count("not a setting remat reads") == SHOWN_PROBLEMS
    assert f"... and {2000 - SHOWN_PROBLEMS:,} more problems" in err


class _Loud:
    def __reduce__(self) -> tuple:
        return (print, ("ran code from a pickle",))


def test_a_snapshot_pickle_that_would_run_code_is_refused(capsys, tmp_path) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "x": _Loud()}))
    code, out, err, _ = run(capsys, "doctor", "--snapshot", str(path), "--limit", "80GiB")
    assert code == 1 and "it names builtins.print; a memory snapshot holds plain data only" in err
    assert "ran code" not in out + err


@pytest.mark.parametrize(
    ("text", "said"),
    [("[1, 2]", "no transformers config (no model_type)"), ("{", "is not valid JSON")],
)
def test_a_config_json_that_is_not_a_transformers_config_is_named(capsys, tmp_path, text, said) -> None:
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(text)
    code, _, err, _ = run(capsys, "verify", "-m", "hf", "--hf_config", str(path))
    assert code == 1 and said in err


@pytest.mark.parametrize(("columns", "width"), [("0", 40), ("5", 40), ("-3", 80), ("100", 100), ("99999999", 1000)])
def test_output_is_laid_out_at_a_readable_width_whatever_columns_says(monkeypatch, columns, width) -> None:
    """Not a number: rich's default of 80."""
    from remat.cli.common import _console

    monkeypatch.setenv("COLUMNS", columns)
    assert _console(stderr=True).width == width


@pytest.mark.slow
def test_columns_zero_still_prints_the_errors() -> None:
    """As found: the console is made at import, so a fresh process with COLUMNS=0."""
    import os
    import subprocess
    import sys

    argv = [sys.executable, "-m", "remat", "validate", "--num_layers", "8", "-rl", "0", "-pp", "3"]
    done = subprocess.run(argv, env={**os.environ, "COLUMNS": "0"}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "invalid config (2 problems)" in done.stderr and "pipeline stages" in " ".join(done.stderr.split())


@pytest.mark.slow
def test_an_interrupted_sweep_keeps_the_configs_it_finished(capsys, tmp_path, monkeypatch) -> None:
    """Ctrl-C in the third of four configs: the two finished are in --json and the history, the
    command says so in one line and exits 130."""
    import json

    import remat.bench.run as bench_run

    real, calls = bench_run.run_bench, []

    def third_interrupted(*args, **kwargs):
        calls.append(kwargs.get("name"))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_run, "run_bench", third_interrupted)
    monkeypatch.setenv("REMAT_HISTORY", str(tmp_path / "history.sqlite"))
    monkeypatch.chdir(tmp_path)
    configs = ["none", "mlp", "core_attn", "full_uniform_1"]
    argv = ["sweep", *TINY_SWEEP, "--configs", *configs, "--json", "sweep.json"]
    code, _, err, _ = run(capsys, *argv)
    assert code == 130 and "interrupted after 2 configs of 4; recording those" in err and "Traceback" not in err
    assert [r["name"] for r in json.loads((tmp_path / "sweep.json").read_text())] == configs[:2]
    code, out, _, _ = run(capsys, "history")
    assert code == 0 and "none" in out and "mlp" in out and not list(tmp_path.glob("*.png"))  # no plot unasked


def test_ctrl_c_anywhere_in_a_command_is_one_line_and_exit_130(capsys, monkeypatch) -> None:
    import remat.cli.validate as validate

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "run", interrupted)
    code, out, err, _ = run(capsys, "validate", "--num_layers", "8")
    assert (code, out, err) == (130, "", "interrupted")
