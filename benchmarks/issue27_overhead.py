"""Issue 27 item 7: what torch.distributed's layouts cost on one GPU. The same remat step (Llama-3-8B
layers, AdamW, bf16) as a plain model, under FSDP2 with one rank (`fully_shard_layers`), and as a
one-stage pipeline under torch's 1F1B schedule (`Pipeline`); FSDP2 also without resharding after
forward (one rank: the shard is the whole layer) and reducing gradients on a step's last
micro-batch only, or (`reduce_once_a_step`, remat's distributed optimizer) also keeping the layers
gathered from a step's first forward to its last backward. With
--main-params, Megatron's precision: the plain model with fp32 main parameters beside its bf16
ones (MainParamsAdamW) against FSDP2 over fp32 parameters gathered in bf16 (AdamW on the fp32
shards), as `remat bench -ng N --main_params_dtype fp32` runs it. Interleaved and repeated so that
drift of the GPU's clock (it runs at its power cap) spreads over all three. Prints one JSON line per
run and writes them to $OUT/issue27_overhead.json.

  torchrun --standalone --nproc-per-node 1 benchmarks/issue27_overhead.py [--layers 4] [--seq 8192] [--main-params]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from remat.bench.run import run_bench
from remat.bench.spec import BenchSpec
from remat.config.parallel import ParallelLayout
from remat.config.recompute import RecomputeConfig
from remat.parallel import Pipeline, fully_shard_layers
from remat.run.build import build_model
from remat.run.optimizer import OptimizerPrecision

PLANS = {
    "none": None,
    "full_uniform_1": RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def layouts(spec: BenchSpec, main_params: bool) -> dict[str, object]:
    """Builders of the models of the same spec: plain, one-stage pipeline, FSDP2 variants."""
    config = spec.model_config

    def sharded(reshard_after_forward: bool = True, reduce_once_a_step: bool = False) -> torch.nn.Module:
        model = build_model(spec)
        if main_params:  # fp32 shards gathered in bf16, gradients reduced in fp32
            return fully_shard_layers(
                model.float(),
                compute_dtype=spec.dtype,
                reshard_after_forward=reshard_after_forward,
                reduce_once_a_step=reduce_once_a_step,
            )
        return fully_shard_layers(
            model, reshard_after_forward=reshard_after_forward, reduce_once_a_step=reduce_once_a_step
        )

    def pipeline() -> torch.nn.Module:
        hidden = torch.empty(
            spec.micro_batch_size, config.seq_length, config.hidden_size, dtype=spec.dtype, device="meta"
        )
        return Pipeline(
            [build_model(spec)], ParallelLayout(pp=1), pipeline_rank=0, hidden=hidden, micro_batches=spec.micro_batches
        )

    def sync_last(model: torch.nn.Module) -> torch.nn.Module:
        """Reduce gradients on the last micro-batch of a step only (FSDP2's no-sync accumulation:
        unsharded gradients held across micro-batches, as Megatron's full gradient buffer)."""
        calls = [0]

        def before(module: torch.nn.Module, args: object) -> None:
            module.set_requires_gradient_sync(calls[0] % spec.micro_batches == spec.micro_batches - 1)  # type: ignore[operator]
            calls[0] += 1

        model.register_forward_pre_hook(before)
        return model

    return {
        "plain": lambda: build_model(spec),
        "fsdp2_1rank": sharded,
        "fsdp2_1rank_no_reshard": lambda: sharded(reshard_after_forward=False),
        "fsdp2_1rank_no_reshard_sync_last": lambda: sync_last(sharded(reshard_after_forward=False)),
        # what remat bench runs for --use_distributed_optimizer: gathered once a step, reduced once
        "fsdp2_1rank_reduce_once": lambda: sharded(reduce_once_a_step=True),
        "pipeline_1stage": pipeline,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--recipe", default="llama3_8b")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test on gloo")
    parser.add_argument("--main-params", action="store_true", help="Megatron's fp32 main parameters (see above)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(0)
    spec = BenchSpec(
        recipe=args.recipe,
        overrides={"num_layers": args.layers, "seq_length": args.seq},
        micro_batch_size=1,
        global_batch_size=args.micro_batches,
        max_steps=10,
        warmup_steps=3,
        device=args.device,
        command="benchmarks/issue27_overhead.py",
    )
    # FSDP2's fp32 shards are the main parameters: its models step plain AdamW on them
    main = dataclasses.replace(spec, optimizer_precision=OptimizerPrecision("fp32")) if args.main_params else spec
    rows = []
    for repeat in range(args.repeats):
        for name, make in layouts(spec, args.main_params).items():
            model = make()  # type: ignore[operator]
            run_spec = spec if name.startswith("fsdp2") else main
            for plan_name, plan in PLANS.items():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    result = run_bench(run_spec, plan, model=model, name=plan_name)
                row = dict(
                    layout=name,
                    plan=plan_name,
                    repeat=repeat,
                    main_params=args.main_params,
                    status=result.status,
                    step_s=result.step_time_s,
                    tflops=result.tflops_per_gpu,
                    peak_gib=(result.peak_allocated_bytes or 0) / 2**30,
                    reserved_gib=(result.peak_reserved_bytes or 0) / 2**30,
                    loss=result.losses[-1] if result.losses else None,
                    gpu=torch.cuda.get_device_name() if cuda else "cpu",
                    torch=torch.__version__,
                )
                print(json.dumps(row), flush=True)
                rows.append(row)
            del model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    name = "issue27_overhead_main_params.json" if args.main_params else "issue27_overhead.json"
    Path(os.environ.get("OUT", "."), name).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
