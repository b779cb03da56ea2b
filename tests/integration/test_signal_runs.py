"""Ctrl-C as a terminal sends it (SIGINT to the process) during a bench's steps: one line, exit
130, no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SRC = str(Path(__file__).parents[2] / "src")


def _as_from_a_terminal() -> None:
    """SIGINT handled as in a terminal's foreground job: a background job (or CI's runner) may start
    its children with SIGINT ignored, which Python then keeps, as every program does."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_ends_a_command_with_one_line_and_130(tmp_path: Path, after_s: float = 15.0) -> None:
    argv = [sys.executable, "-m", "remat", "bench", "-mr", "llama3_tiny", "-ms", "100000", "--no_history"]
    env = {**os.environ, "PYTHONPATH": SRC}
    p = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_from_a_terminal,
    )
    time.sleep(after_s)
    p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()  # never left running
    assert p.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
