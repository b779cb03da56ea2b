"""Issue 27 item 7: what torch.distributed's layouts cost on one GPU. The same remat step (Llama-3-8B
layers, AdamW, bf16) as a plain model, under FSDP2 with one rank (`fully_shard_layers`), and as a
one-stage pipeline under torch's 1F1B schedule (`Pipeline`); FSDP2 also without resharding after
forward (one rank: the shard is the whole layer) and reducing gradients on a step's last
micro-batch only. Interleaved and repeated so that
drift of the GPU's clock (it runs at its power cap) spreads over all three. Prints one JSON line per
run and writes them to $OUT/issue27_overhead.json.

  torchrun --standalone --nproc-per-node 1 benchmarks/issue27_overhead.py [--layers 4] [--seq 8192]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from remat.bench.run import run_bench
from remat.bench.spec import BenchSpec
from remat.parallel import Pipeline, PipelineLayout, fully_shard_layers
from remat.recompute import RecomputeConfig
from remat.step import build_model

PLANS = {"none": None, "full_uniform_1": RecomputeConfig(recompute_granularity="full", recompute_method="uniform",
                                                          recompute_num_layers=1)}


def layouts(spec: BenchSpec) -> dict[str, object]:
    """Builders of the three models of the same spec."""
    config = spec.model_config

    def pipeline() -> torch.nn.Module:
        hidden = torch.empty(spec.micro_batch_size, config.seq_length, config.hidden_size, dtype=spec.dtype,
                             device="meta")
        return Pipeline([build_model(spec)], PipelineLayout(1), pipeline_rank=0, hidden=hidden,
                        micro_batches=spec.micro_batches)
    def sync_last(model: torch.nn.Module) -> torch.nn.Module:
        """Reduce gradients on the last micro-batch of a step only (FSDP2's no-sync accumulation:
        unsharded gradients held across micro-batches, as Megatron's full gradient buffer)."""
        calls = [0]

        def before(module: torch.nn.Module, args: object) -> None:
            module.set_requires_gradient_sync(calls[0] % spec.micro_batches == spec.micro_batches - 1)  # type: ignore[operator]
            calls[0] += 1
        model.register_forward_pre_hook(before)
        return model
    return {"plain": lambda: build_model(spec), "fsdp2_1rank": lambda: fully_shard_layers(build_model(spec)),
            "fsdp2_1rank_no_reshard": lambda: fully_shard_layers(build_model(spec), reshard_after_forward=False),
            "fsdp2_1rank_no_reshard_sync_last": lambda: sync_last(
                fully_shard_layers(build_model(spec), reshard_after_forward=False)),
            "pipeline_1stage": pipeline}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--recipe", default="llama3_8b")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test on gloo")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(0)
    spec = BenchSpec(recipe=args.recipe, overrides={"num_layers": args.layers, "seq_length": args.seq},
                     micro_batch_size=1, global_batch_size=args.micro_batches, max_steps=10, warmup_steps=3,
                     device=args.device, command="benchmarks/issue27_overhead.py")
    rows = []
    for repeat in range(args.repeats):
        for name, make in layouts(spec).items():
            model = make()  # type: ignore[operator]
            for plan_name, plan in PLANS.items():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    result = run_bench(spec, plan, model=model, name=plan_name)
                row = dict(layout=name, plan=plan_name, repeat=repeat, status=result.status,
                           step_s=result.step_time_s, tflops=result.tflops_per_gpu,
                           peak_gib=(result.peak_allocated_bytes or 0) / 2**30,
                           reserved_gib=(result.peak_reserved_bytes or 0) / 2**30,
                           loss=result.losses[-1] if result.losses else None,
                           gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__)
                print(json.dumps(row), flush=True)
                rows.append(row)
            del model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    Path(os.environ.get("OUT", "."), "issue27_overhead.json").write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
