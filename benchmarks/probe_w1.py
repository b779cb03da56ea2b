"""Quick W1 probe (forward+backward, no optimizer, as the anchor measures): remat's model under a
few plans, eager and with each layer's inner forward compiled. Exploration for the bench issue.

  python benchmarks/probe_w1.py MODES   MODES: comma list of none, mlp, full1, cnone, cmlp
"""
from __future__ import annotations

import json
import sys
import warnings

import torch

import remat
from remat.models import build

L, S, B = 8, 8192, 2


def flops(cfg) -> float:
    h, f, v, g, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.num_query_groups, cfg.head_dim
    p_layer = 2 * h * h + 2 * h * g * d + 3 * h * f
    return 6 * (L * p_layer + h * v) * B * S + 6 * L * 2 * B * S * S * h


def run(model, mode: str, steps: int = 8, warm: int = 3) -> dict:
    plans = {"none": None, "mlp": remat.RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"]),
             "full1": remat.RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}
    remat.apply(model, plans[mode.lstrip("c")])
    ids = torch.randint(0, 128256, (B, S), device="cuda")
    for p in model.parameters():
        p.grad = None
    for _ in range(warm):
        model(ids, ids).backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(steps):
        st.record(); loss = model(ids, ids); loss.backward(); en.record(); torch.cuda.synchronize()
        ts.append(st.elapsed_time(en) / 1e3)
    t = sorted(ts)[len(ts) // 2]
    return dict(mode=mode, step_s=round(t, 4), tflops=round(flops(model.config) / t / 1e12, 1),
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), loss=round(loss.item(), 4))


def main() -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = build("llama3_8b", dtype=torch.bfloat16, device="cuda", num_layers=L, seq_length=S)
    compiled = False
    for mode in sys.argv[1].split(","):
        if mode.startswith("c") and not compiled:
            compiled = True
            for layer in model.decoder.layers:
                layer.self_attention.forward = torch.compile(layer.self_attention.forward)
                layer.mlp.forward = torch.compile(layer.mlp.forward)
        print(json.dumps(run(model, mode)), flush=True)


if __name__ == "__main__":
    main()
