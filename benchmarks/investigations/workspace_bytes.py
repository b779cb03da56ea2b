"""Library workspaces that stay allocated through torch's caching allocator, and so count in
`max_memory_allocated` without belonging to any tensor: what remat's estimate (shapes on the meta
device) cannot see unless it adds them.

Each case runs in a fresh process (workspaces live as long as the process) and prints the bytes
`torch.cuda.memory_allocated()` grew by, beyond the case's own tensors, after:
  main_mm        a bf16 matmul on the main thread (cuBLAS's workspace for this thread's handle)
  backward_mm    then a backward through a matmul (autograd runs CUDA backward on its own thread,
                 whose cuBLAS handle gets its own workspace)
  second_step    then a second forward and backward (nothing new expected)
  sdpa           a causal cuDNN attention forward+backward after the above

  PYTHONPATH=src python benchmarks/investigations/workspace_bytes.py [--env CUBLAS_WORKSPACE_CONFIG=:4096:2]
writes $OUT/workspace_bytes.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

OUT = Path(os.environ.get("OUT", "."))


def _case() -> dict[str, int]:
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    x = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    grown: dict[str, int] = {}

    def mark(name: str, held: int) -> None:
        torch.cuda.synchronize()
        grown[name] = torch.cuda.memory_allocated() - held

    held = torch.cuda.memory_allocated()
    with torch.no_grad():
        y = x @ w
    mark("main_mm", held + y.numel() * y.element_size())
    del y
    held = torch.cuda.memory_allocated()
    (x @ w).float().sum().backward()
    mark("backward_mm", held + w.numel() * w.element_size())  # w.grad
    held = torch.cuda.memory_allocated()
    (x @ w).float().sum().backward()
    mark("second_step", held)
    q = torch.randn(1, 32, 4096, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, 4096, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 8, 4096, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    held = torch.cuda.memory_allocated()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).float().sum().backward()
    mark("sdpa", held + sum(t.numel() * t.element_size() for t in (q, k, v)))
    return grown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also run with this environment variable set (repeatable)",
    )
    parser.add_argument("--case", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case()))
        return
    import torch

    runs = {}
    for setting in ["", *args.env]:
        env = dict(os.environ)
        if setting:
            name, value = setting.split("=", 1)
            env[name] = value
        out = subprocess.run(
            [sys.executable, __file__, "--case"], env=env, check=True, capture_output=True, text=True
        ).stdout
        runs[setting or "default"] = json.loads(out.strip().splitlines()[-1])
        print(setting or "default", runs[setting or "default"], flush=True)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": "PYTHONPATH=src python benchmarks/investigations/workspace_bytes.py "
        + " ".join(f"--env {e}" for e in args.env),
        "bytes_grown": runs,
    }
    (OUT / "workspace_bytes.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
