"""Where transformers' models lose GPU time against remat's own through remat's fast path (bf16,
no recompute, no optimizer): kernel time by kind and the top kernels over two forward+backward
steps (profile_w1's profiler). `llama`: LlamaForCausalLM beside `llama3_8b` at W1 (8 layers,
seq 8192, micro-batch 2); `moe`: Qwen3-MoE beside `qwen3_30b_a3b` (4 layers, seq 4096,
micro-batch 4).

  PYTHONPATH=src:benchmarks python benchmarks/profile_hf.py [llama] [moe]   writes $OUT/profile_hf.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from hf_llama import llama_config
from hf_moe import SLICES
from profile_w1 import _profile

from remat.bench import BenchSpec
from remat.run.step import MockData, build_model
from remat.sites.calls import forward_loss

OUT = Path(os.environ.get("OUT", "."))


def step(recipe: str, overrides: dict, micro_batch: int) -> object:
    spec = BenchSpec(
        recipe=recipe, overrides=overrides, micro_batch_size=micro_batch, device="cuda", compile=True, optimizer=False
    )
    model = build_model(spec)
    ids, labels = MockData(spec).batch()
    return lambda: forward_loss(model, ids, labels).backward()


def pairs(which: list[str]) -> list[tuple[str, str, dict, int]]:
    """(name, recipe, overrides, micro-batch) of each run, remat's model first."""
    rows = []
    if "llama" in which:
        config = OUT / "llama_w1_config.json"
        config.write_text(json.dumps(llama_config(layers=8, seq=8192).to_dict()))
        rows += [
            ("remat_llama3_8b", "llama3_8b", {"num_layers": 8, "seq_length": 8192}, 2),
            ("hf_llama", f"hf:{config}", {"seq_length": 8192}, 2),
        ]
    if "moe" in which:
        fields, seq, _, _ = SLICES["qwen3_moe"]
        config = OUT / "qwen3_moe_slice_config.json"
        config.write_text(json.dumps(dict(fields, model_type="qwen3_moe", max_position_embeddings=seq)))
        rows += [
            ("remat_qwen3_30b_a3b", "qwen3_30b_a3b", {"num_layers": 4, "seq_length": seq}, 4),
            ("hf_qwen3_moe", f"hf:{config}", {"seq_length": seq}, 4),
        ]
    return rows


def main(which: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, recipe, overrides, micro_batch in pairs(which):
        results[name] = _profile(step(recipe, overrides, micro_batch))
        print(name, json.dumps(results[name], indent=1), flush=True)
        torch.cuda.empty_cache()
    results["gpu"] = torch.cuda.get_device_name()
    (OUT / "profile_hf.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:] or ["llama", "moe"])
