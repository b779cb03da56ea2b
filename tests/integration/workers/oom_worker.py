"""Run by tests/integration/test_doctor_ranks_runs.py: `remat ARGV`, where under torchrun rank 1
runs out of memory in its first MLP forward and rank 0 does not. The OOM is CUDA's, simulated on
CPU: torch's message with rank 1's numbers (RANK1_MESSAGE). In the process that starts torchrun (no
RANK), torchrun runs this script on each rank instead of `python -m remat`."""

from __future__ import annotations

import os
import sys

import torch

from remat.cli import main
from remat.models.llama import MLP
from remat.parallel import launch

# rank 1's numbers as torch >= 2.1 writes them: 75.80 GiB allocated, 77.00 GiB reserved, of 79.11 GiB
RANK1_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.11 GiB of which"
    " 1.05 GiB is free. Including non-PyTorch memory, this process has 78.05 GiB memory in use. Of the"
    " allocated memory 75.80 GiB is allocated by PyTorch, and 1.20 GiB is reserved by PyTorch but"
    " unallocated."
)
REAL_FORWARD = MLP.forward


def out_of_memory(self: MLP, x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "meta":  # the check of what a CPU step needs, before the run
        return REAL_FORWARD(self, x)
    raise torch.OutOfMemoryError(RANK1_MESSAGE)


if __name__ == "__main__":
    if "RANK" not in os.environ:
        launch.RANK_PROGRAM = (__file__,)
    elif os.environ["RANK"] == "1":
        MLP.forward = out_of_memory  # type: ignore[method-assign]
    sys.exit(main(sys.argv[1:]))
