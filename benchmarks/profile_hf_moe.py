"""Where the Qwen3-30B-A3B slice's GPU time goes: transformers' Qwen3-MoE through remat's fast path
beside remat's own `qwen3_30b_a3b` (4 layers, seq 4096, micro-batch 4, bf16, no recompute, no
optimizer), kernel time by kind and the top kernels over two forward+backward steps
(profile_w1's profiler).

  PYTHONPATH=src:benchmarks python benchmarks/profile_hf_moe.py     writes $OUT/profile_hf_moe.json
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from hf_moe import SLICES
from profile_w1 import _profile

from remat.bench import BenchSpec
from remat.run.step import MockData, build_model
from remat.sites.calls import forward_loss

OUT = Path(os.environ.get("OUT", "."))


def step(recipe: str, overrides: dict) -> object:
    spec = BenchSpec(
        recipe=recipe, overrides=overrides, micro_batch_size=4, device="cuda", compile=True, optimizer=False
    )
    model = build_model(spec)
    ids, labels = MockData(spec).batch()
    return lambda: forward_loss(model, ids, labels).backward()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    fields, seq, _, _ = SLICES["qwen3_moe"]
    config = OUT / "qwen3_moe_slice_config.json"
    config.write_text(json.dumps(dict(fields, model_type="qwen3_moe", max_position_embeddings=seq)))
    results = {}
    for name, recipe, overrides in (
        ("remat_qwen3_30b_a3b", "qwen3_30b_a3b", {"num_layers": 4, "seq_length": seq}),
        ("hf_qwen3_moe", f"hf:{config}", {"seq_length": seq}),
    ):
        results[name] = _profile(step(recipe, overrides))
        print(name, json.dumps(results[name], indent=1), flush=True)
        torch.cuda.empty_cache()
    results["gpu"] = torch.cuda.get_device_name()
    (OUT / "profile_hf_moe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
