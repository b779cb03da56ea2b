"""FP8 with current scaling (`-c fp8_cs`, torchao's float8 training) on one GPU, beside the anchor
(benchmarks/anchors/torchao_fp8.py: torchao tensorwise + torch.compile on the same shapes, a
verbatim copy of shared/anchors), forward+backward, no optimizer, as the anchor measures.

  w1:  8 Llama-3-8B layers, seq 8192, micro-batch 2: the anchor (bf16 and tensorwise, none and
       full), then remat compiled in bf16 (none) and fp8_cs (Megatron's presets)
  70b: Llama-3-70B dimensions, 4 layers, seq 4096, micro-batch 1, fp8_cs: the source skill's
       table in kind (each preset's TFLOP/s cost against none)

  pip install --no-deps .whl/torchao-*.whl   (the device has no torchao)
  PYTHONPATH=src python benchmarks/fp8_bench.py [w1,70b]    writes $OUT/fp8_<part>.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from remat.bench import BenchSpec, sweep
from remat.bench.presets import parse_entry
from remat.config.precision import Precision

OUT = Path(os.environ.get("OUT", "."))
ANCHOR = Path(__file__).parent / "anchors" / "torchao_fp8.py"
PRESETS = ["none", "core_attn", "layernorm", "mlp", "mlp+core_attn", "core_attn+layernorm", "full_uniform_1"]
SHAPES = {
    "w1": dict(recipe="llama3_8b", overrides={"num_layers": 8, "seq_length": 8192}, micro_batch_size=2),
    "70b": dict(recipe="llama3_70b", overrides={"num_layers": 4, "seq_length": 4096}, micro_batch_size=1),
}


def _time(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats / 1e3


def gemm_limit() -> dict:
    """The W1 step's GEMMs alone at this GPU's measured rates: each linear's three GEMMs (forward,
    input and weight gradients) in FP8 (torch._scaled_mm, tensorwise) and the output head's in
    bf16; what no FP8 run of W1 can beat, before attention, casts and elementwise work."""
    tokens, hidden, ffn, kv, vocab, layers = 2 * 8192, 4096, 14336, 1024, 128256, 8
    one = torch.ones((), device="cuda")
    fp8 = torch.float8_e4m3fn

    def scaled(m: int, k: int, n: int) -> float:
        a = torch.randn(m, k, device="cuda").to(fp8)
        b = torch.randn(n, k, device="cuda").to(fp8).t()
        return _time(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))

    def bf16(m: int, k: int, n: int) -> float:
        a, b = (
            torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
            torch.randn(k, n, device="cuda", dtype=torch.bfloat16),
        )
        return _time(lambda: a @ b)

    linears = [(hidden, hidden + 2 * kv), (hidden, hidden), (hidden, 2 * ffn), (ffn, hidden)]
    seconds = 0.0
    for k, n in linears:  # forward [t,k]x[k,n]; grad input [t,n]x[n,k]; grad weight [n,t]x[t,k]
        seconds += layers * (scaled(tokens, k, n) + scaled(tokens, n, k) + scaled(n, tokens, k))
    head = bf16(tokens, hidden, vocab) + bf16(tokens, vocab, hidden) + bf16(vocab, tokens, hidden)
    flops = 6 * tokens * (layers * sum(k * n for k, n in linears) + hidden * vocab)
    return dict(
        gemm_s=round(seconds + head, 4),
        linears_fp8_s=round(seconds, 4),
        head_bf16_s=round(head, 4),
        gemm_tflops=round(flops / (seconds + head) / 1e12, 1),
    )


def anchor() -> list[dict]:
    """The anchor's rows, its output streamed to $OUT/anchor.log (kept if the call runs out)."""
    env = {**os.environ, "L": "8", "S": "8192", "B": "2"}
    log = OUT / "anchor.log"
    with log.open("w") as out:
        subprocess.run([sys.executable, str(ANCHOR), "tensorwise"], env=env, stdout=out, stderr=subprocess.STDOUT)
    lines = log.read_text().splitlines()
    print("\n".join(lines[-30:]), flush=True)
    return [json.loads(line) for line in lines if line.startswith('{"mode"')]


def remat(part: str, dtype: str, presets: list[str]) -> list[dict]:
    shape = SHAPES[part]
    spec = BenchSpec(
        **shape,
        max_steps=8,
        warmup_steps=3,
        device="cuda",
        compile=True,
        optimizer=False,
        precision=Precision(dtype),
    )
    facts = {"num_layers": shape["overrides"]["num_layers"], "attention_dropout": 0.0, "hidden_dropout": 0.0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = [parse_entry(p, facts) for p in presets]
    rows = []
    for r in sweep(spec, plans):
        row = dict(
            part=part,
            dtype=dtype,
            mode=r.name,
            status=r.status,
            tflops=round(r.tflops_fwd_bwd, 1) if r.tflops_fwd_bwd else None,
            step_s=round(r.fwd_bwd_time_s, 4) if r.fwd_bwd_time_s else None,
            peak_gib=round(r.peak_allocated_bytes / 2**30, 2) if r.peak_allocated_bytes else None,
            loss=r.losses[-1] if r.losses else None,
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["w1", "70b"]
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, command=" ".join(sys.argv))
    for part in parts:
        found: dict = dict(meta)
        path = OUT / f"fp8_{part}.json"

        def record(key: str, rows: object) -> None:  # written as it goes: a call may run out
            found[key] = rows
            path.write_text(json.dumps(found, indent=1) + "\n")

        if part == "w1":
            record("remat", remat(part, "fp8_cs", ["none"]))
            record("limit", gemm_limit())
            print(json.dumps(found["limit"]), flush=True)
            record("anchor", anchor())
            record("remat", found["remat"] + remat(part, "bf16", ["none"]))
            record("remat", found["remat"] + remat(part, "fp8_cs", ["mlp", "full_uniform_1"]))
        else:
            record("remat", remat(part, "fp8_cs", PRESETS))


if __name__ == "__main__":
    main()
