"""remat on transformers' own MoE models: a Qwen3-30B-A3B-shaped slice and a DeepSeek-V3-shaped
slice (true widths, fewer layers and experts to fit one GPU), forward + backward + fused AdamW,
bf16, SDPA, transformers' grouped_mm experts. Each label remat places, alone, beside no recompute,
full recompute, and HF's own runs without and with gradient checkpointing, in the same process.

  PYTHONPATH=src:benchmarks python benchmarks/hf_moe.py [--only qwen3_moe|deepseek_v3]
  writes $OUT/hf_moe.json

TFLOP/s counts active parameters (routed experts at top-k of all; remat's `hf` family FLOPs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers
from hf_llama import measure, timing_fields

import remat
from remat.config.megatron import TrainingFacts
from remat.config.recompute import RecomputeConfig
from remat.core.problems import RematWarning
from remat.models.hf.family import HfFamily, HfModelConfig
from remat.sites.placement import compile_sites

OUT = Path(os.environ.get("OUT", "."))
GIB = 2**30
SLICES = {
    # Qwen3-30B-A3B: 4 of 48 layers, all 128 experts; (config, sequence, micro-batch, labels): micro-batches
    # large enough that activations, not the optimizer step, set the peak
    "qwen3_moe": (
        dict(
            hidden_size=2048,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            vocab_size=151936,
            norm_topk_prob=True,
        ),
        4096,
        4,
        ("core_attn", "layernorm", "moe", "moe_act"),
    ),
    # DeepSeek-V3: 1 dense + 3 MoE layers, MLA ranks as published, 16 of 256 experts at the true width
    "deepseek_v3": (
        dict(
            hidden_size=7168,
            num_hidden_layers=4,
            num_attention_heads=128,
            num_key_value_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            n_routed_experts=16,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            vocab_size=129280,
        ),
        4096,
        2,
        ("core_attn", "layernorm", "mlp", "mla_up_proj", "moe", "moe_act", "shared_experts"),
    ),
}


def configs(labels: tuple[str, ...]) -> list[tuple[str, RecomputeConfig | None]]:
    facts = TrainingFacts(moe_grouped_gemm=True, multi_latent_attention="mla_up_proj" in labels)
    return [
        ("none", None),
        *(
            (label, RecomputeConfig(recompute_granularity="selective", recompute_modules=[label], facts=facts))
            for label in labels
        ),
        (
            "full_uniform_1",
            RecomputeConfig(
                recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1, facts=facts
            ),
        ),
    ]


def run_slice(name: str) -> list[dict]:
    fields, seq, mb, labels = SLICES[name]
    hf = transformers.AutoConfig.for_model(
        name, max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa", **fields
    )
    flops = HfFamily().flops(HfModelConfig(name, hf, seq), seq, mb)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    model.train()
    ids = torch.randint(0, hf.vocab_size, (mb, seq), device="cuda")
    rows = []

    def record(mode: str, result: dict) -> None:
        row = dict(model=name, mode=mode, experts=model.config._experts_implementation, **timing_fields(result, flops))  # noqa: F821 (run before the model is deleted)
        rows.append(row)
        print(json.dumps(row), flush=True)

    record("hf", measure(model, ids, warmup=2, steps=4))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    record("hf_gradient_checkpointing", measure(model, ids, warmup=2, steps=4))
    model.gradient_checkpointing_disable()
    remat.adapt(model, loss_head=True)
    compile_sites(model)
    for mode, config in configs(labels):
        remat.apply(model, config)
        record(f"remat_{mode}", measure(model, ids, warmup=2, steps=4))
    remat.apply(model, None)
    del model
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    warnings.simplefilter("ignore", RematWarning)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=sorted(SLICES))
    args = parser.parse_args()
    rows = [row for name in ([args.only] if args.only else SLICES) for row in run_slice(name)]
    result = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        date=time.strftime("%Y-%m-%d"),
        command="PYTHONPATH=src:benchmarks python benchmarks/hf_moe.py " + " ".join(sys.argv[1:]),
        slices={k: dict(v[0], seq_length=v[1], micro_batch_size=v[2]) for k, v in SLICES.items()},
        rows=rows,
    )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "hf_moe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
