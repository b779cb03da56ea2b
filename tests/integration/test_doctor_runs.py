"""`remat doctor --timeline` end to end: one step of the tiny Llama on CPU, plotted to a PNG.

The quick tests of the same code: tests/unit/doctor/test_doctor.py."""

from __future__ import annotations

import pytest

from remat.cli import main


@pytest.mark.parametrize("dtype", ["bf16", "fp8_cs"])
def test_cli_timeline_writes_a_png_of_one_step_on_cpu(tmp_path, capsys, dtype) -> None:
    out = tmp_path / "step.png"
    flags = ["-mr", "llama3_tiny", "--num_layers", "2", "-sl", "32", "--device", "cpu", "-rl", "1", "-c", dtype]
    assert main(["doctor", "--timeline", str(out), *flags]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    said = capsys.readouterr().out
    assert "peak allocated" in said
    assert ("in FP8 (kept inputs and casts)" in said) == (dtype == "fp8_cs")
