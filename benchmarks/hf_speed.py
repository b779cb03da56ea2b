"""transformers' models against remat's own at the same shapes, through `remat bench` (bf16, the
compiled fast path, no recompute), in one process: Llama at W1 (8 Llama-3-8B layers, seq 8192,
micro-batch 2) and the Qwen3-30B-A3B slice (4 layers, seq 4096, micro-batch 4); each HF model
with and without the fusions of `remat.models.hf.fusions`.

  PYTHONPATH=src:benchmarks python benchmarks/hf_speed.py     writes $OUT/hf_speed.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import transformers
from hf_llama import llama_config
from hf_moe import SLICES

from remat.cli import main
from remat.models.hf import fusions

OUT = Path(os.environ.get("OUT", "."))
RUN = ["-ms", "10", "--warmup_steps", "4", "--no_history", "--no_progress"]
W1 = ["-sl", "8192", "-mb", "2", "-gb", "2"]
MOE = ["-sl", "4096", "-mb", "4", "-gb", "4"]


def bench(name: str, argv: list[str]) -> dict:
    out = OUT / f"{name}.json"
    code = main(["bench", *argv, *RUN, "--json", str(out)])
    result = json.loads(out.read_text()) if out.exists() else {}
    return {"name": name, "exit": code, "argv": argv, "result": result}


def main_() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    moe_fields, moe_seq, _, _ = SLICES["qwen3_moe"]
    shapes = {  # the HF models' config.json files
        "llama_w1": llama_config(layers=8, seq=8192).to_dict(),
        "qwen3_moe_slice": dict(moe_fields, model_type="qwen3_moe", max_position_embeddings=moe_seq),
    }
    configs = {}
    for name, fields in shapes.items():
        path = OUT / f"{name}_config.json"
        path.write_text(json.dumps(fields))
        configs[name] = str(path)
    fused = fusions.compile_rotary, fusions.compile_routers, fusions.use_grouped_experts
    # transformers' models first without the fusions (a swapped function stays swapped)
    fusions.compile_rotary = fusions.compile_routers = fusions.use_grouped_experts = lambda model: 0  # type: ignore[assignment]
    rows = [
        bench("remat_llama3_8b", ["-mr", "llama3_8b", "--num_layers", "8", *W1]),
        bench("hf_llama_unfused", ["-m", "hf", "--hf_config", configs["llama_w1"], *W1]),
        bench("remat_qwen3_30b_a3b", ["-mr", "qwen3_30b_a3b", "--num_layers", "4", *MOE]),
        bench("hf_qwen3_moe_unfused", ["-m", "hf", "--hf_config", configs["qwen3_moe_slice"], *MOE]),
    ]
    fusions.compile_rotary, fusions.compile_routers, fusions.use_grouped_experts = fused
    rows += [
        bench("hf_llama", ["-m", "hf", "--hf_config", configs["llama_w1"], *W1]),
        bench("hf_qwen3_moe", ["-m", "hf", "--hf_config", configs["qwen3_moe_slice"], *MOE]),
    ]
    record = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rows": rows,
    }
    (OUT / "hf_speed.json").write_text(json.dumps(record, indent=1))
    for row in rows:
        print(row["name"], row["exit"], {k: v for k, v in row["result"].items() if "step" in k or "tflops" in k})


if __name__ == "__main__":
    sys.exit(main_())
