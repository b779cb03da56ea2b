"""`remat doctor --timeline` end to end: one step of the tiny Llama on CPU, plotted to a PNG.

The quick tests of the same code: tests/unit/doctor/test_doctor.py."""

from __future__ import annotations

from remat.cli import main


def test_cli_timeline_writes_a_png_of_one_step_on_cpu(tmp_path, capsys) -> None:
    out = tmp_path / "step.png"
    assert (
        main(
            [
                "doctor",
                "--timeline",
                str(out),
                "-mr",
                "llama3_tiny",
                "--num_layers",
                "2",
                "-sl",
                "32",
                "--device",
                "cpu",
                "-rl",
                "1",
            ]
        )
        == 0
    )
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert "peak allocated" in capsys.readouterr().out
