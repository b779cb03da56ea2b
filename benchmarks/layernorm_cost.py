"""Is `layernorm` recompute (and `core_attn`) a real cost with compiled regions on Llama-3-70B dims?

The issue: one device call measured `layernorm` 3.5% and `core_attn` 4.2% slower than no recompute
(616.4 against 639.0 TFLOP/s, four timed steps each) on 4 layers of Llama-3-70B at seq 4096,
micro-batch 1, bf16, compiled regions. A layernorm discard replays two RMSNorm forwards a layer
(~0.2% of the step in theory), a core_attn recompute one attention forward (~1%). Configs timed one
after the other in a call also drift with the GPU's clocks (it runs at its power cap), so here:

1. the GPU first runs no-recompute steps for a while (the step-time trend is recorded: the drift
   a config timed first would see);
2. none, layernorm, core_attn and mlp_act run in interleaved blocks over several rounds, the order
   rotated each round; each step is timed with CUDA events (forward+backward, and the whole step
   with fused AdamW), and nvidia-smi (read only) samples SM clock, temperature and power per block;
3. each config is compared with none round by round: a difference counts as real only when every
   round gives it the same sign and it is larger than how far none itself moved between rounds;
4. one step of each config runs under torch.profiler: GPU time by kernel group, and the kernels the
   config adds over none (names, calls, microseconds);
5. one round of none and layernorm without compiled regions, for contrast.

  PYTHONPATH=src python benchmarks/layernorm_cost.py [--rounds 3] [--steps 20] [--gpu-warmup-s 20]
  PYTHONPATH=src python benchmarks/layernorm_cost.py --tiny   (CPU, llama3_tiny: checks the logic only;
      its times mean nothing: after the harness's CPU memory step, run under a dispatch mode,
      Dynamo traces remat's saved-tensor hooks where a compiled region saves tensors, which
      dynamo_frames shows; on CUDA no compiled region inside a layer saves any)
  writes $OUT/layernorm_cost.json (OUT defaults to ./out), also after each phase; about 3 minutes
  on one H200 (12 blocks of 22 steps of ~0.2 s, 20 s of warm-up, the first compile, 4 profiled
  steps, the eager round), 4 with a cold compile cache.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters as dynamo_counters
from torch.profiler import ProfilerActivity, profile

import remat
from remat import RecomputeConfig
from remat.bench import BenchSpec, run_bench

OUT = Path(os.environ.get("OUT", "out"))
GIB = 2**30
CONFIGS = ("none", "layernorm", "core_attn", "mlp_act")
EAGER_CONFIGS = ("none", "layernorm")


@dataclass(frozen=True)
class Shape:
    recipe: str
    overrides: dict[str, int]
    micro_batch: int


SHAPES = {
    "70b": Shape("llama3_70b", {"num_layers": 4, "seq_length": 4096}, 1),
    "tiny": Shape("llama3_tiny", {}, 1),
}

# Kernel (on CPU: aten op) name fragments by group, first match wins: attention before GEMM
# (cuDNN's attention kernels are GEMM-like), norms before Triton (remat's RMSNorm is a Triton
# kernel), inductor's fused kernels before copies (their names may contain "copy").
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "cudnn", "sdpa", "attention")),
    ("norm", ("rms_norm", "layer_norm", "rmsnorm")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "aten::mm", "addmm", "bmm")),
    ("optimizer", ("adam", "multi_tensor")),
    ("elementwise/triton", ("triton", "silu", "rotary", "cross_entropy")),
    ("copies", ("memcpy", "memset", "copy", "catarray", "clone", "contiguous")),
    ("elementwise/triton", ("elementwise", "reduce", "aten::add", "aten::mul")),
)


def group_of(name: str) -> str:
    low = name.lower()
    return next((group for group, keys in GROUPS if any(k in low for k in keys)), "other")


def recompute_config(name: str) -> RecomputeConfig | None:
    """Megatron's selective recompute of one label; "none" is no recompute."""
    if name == "none":
        return None
    return RecomputeConfig(recompute_granularity="selective", recompute_modules=[name])


# ---- one training step ---------------------------------------------------------------------------


@dataclass
class Run:
    """A model with its optimizer and one fixed batch: what every step of a phase trains on."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    input_ids: torch.Tensor
    labels: torch.Tensor

    @property
    def cuda(self) -> bool:
        return self.input_ids.is_cuda


def build_run(shape: Shape, device: str, compiled: bool) -> Run:
    torch.manual_seed(0)
    model = remat.models.build(shape.recipe, dtype=torch.bfloat16, device=device, **shape.overrides)
    if compiled:
        model.compile_regions()
    vocab, seq = model.config.vocab_size, model.config.seq_length
    tokens = torch.randint(0, vocab, (shape.micro_batch, seq + 1), device=device)
    # fused AdamW as remat's bench harness runs it on the GPU
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda"
    )
    return Run(model, optimizer, tokens[:, :-1], tokens[:, 1:].clone())


@dataclass(frozen=True)
class StepTime:
    fwd_bwd_s: float
    step_s: float  # forward, backward and the optimizer step
    wall_s: float  # host time, from the step's first launch to its end


class Clock:
    """CUDA events on the GPU (no sync inside a step), the wall clock on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


def train_step(run: Run, clock: Clock) -> StepTime:
    wall = time.perf_counter()
    start = clock.mark()
    loss = run.model(run.input_ids, run.labels)
    loss.backward()
    mid = clock.mark()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    end = clock.mark()
    loss.item()  # the step's one host sync, as in remat's bench harness: the events are done after it
    return StepTime(clock.seconds(start, mid), clock.seconds(start, end), time.perf_counter() - wall)


# ---- timed blocks --------------------------------------------------------------------------------


@contextlib.contextmanager
def gpu_sampled(enabled: bool) -> Iterator[dict[str, float]]:
    """Medians of the SM clock (MHz), temperature (C) and power (W) that nvidia-smi (read only)
    samples every 100 ms while the block runs; left empty without a GPU or nvidia-smi."""
    medians: dict[str, float] = {}
    fields = ("clocks.sm", "temperature.gpu", "power.draw")
    if not enabled or shutil.which("nvidia-smi") is None:
        yield medians
        return
    sampler = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield medians
    finally:
        sampler.terminate()
        output, _ = sampler.communicate()
        rows = [line.split(",") for line in output.splitlines()]
        for i, name in enumerate(fields):
            values = [v for v in (_number(r[i]) for r in rows if len(r) == len(fields)) if v is not None]
            if values:
                medians[name] = statistics.median(values)


def _number(text: str) -> float | None:
    """A sample's value; None for nvidia-smi's [N/A] or a line cut short when it was stopped."""
    try:
        return float(text)
    except ValueError:
        return None


def dynamo_frames() -> int:
    """Frames torch.compile has compiled so far in this process. A rise after the first steps is
    Dynamo at work inside a step: a recompile, or remat's saved-tensor hooks traced because they
    fired inside a compiled frame (what a compiled region that saves tensors, run inside a
    discarding layer, does on CPU)."""
    return dynamo_counters["frames"]["total"]


def apply_config(run: Run, name: str) -> list[str]:
    """Install the config; returns what remat warned (core_attn under SDPA frees almost nothing)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remat.apply(run.model, recompute_config(name))
    return [str(w.message) for w in caught]


@dataclass
class Block:
    config: str
    round: int
    steps: list[StepTime]
    peak_bytes: int | None
    compiles_warmup: int
    compiles_timed: int
    gpu: dict[str, float]
    warnings: list[str]

    def median_ms(self, what: str = "fwd_bwd_s") -> float:
        return statistics.median(getattr(s, what) for s in self.steps) * 1e3


def time_block(run: Run, clock: Clock, name: str, round_: int, warmup: int, steps: int) -> Block:
    said = apply_config(run, name)
    frames = dynamo_frames()
    for _ in range(warmup):  # the allocator settles into the config's pattern
        train_step(run, clock)
    if run.cuda:
        torch.cuda.reset_peak_memory_stats()
    warm = dynamo_frames()
    with gpu_sampled(run.cuda) as gpu:
        times = [train_step(run, clock) for _ in range(steps)]
    peak = torch.cuda.max_memory_allocated() if run.cuda else None
    block = Block(name, round_, times, peak, warm - frames, dynamo_frames() - warm, gpu, said)
    print(
        f"round {round_} {name:<10} fwd+bwd {block.median_ms():8.2f} ms  step {block.median_ms('step_s'):8.2f} ms"
        f"  {gpu}",
        flush=True,
    )
    return block


def time_rounds(run: Run, clock: Clock, configs: tuple[str, ...], rounds: int, warmup: int, steps: int) -> list[Block]:
    """Every config once a round, the order rotated each round so none is not always first."""
    blocks = []
    for r in range(rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        blocks += [time_block(run, clock, name, r, warmup, steps) for name in order]
    return blocks


def gpu_warmup(run: Run, clock: Clock, seconds: float) -> dict[str, Any]:
    """No-recompute steps for `seconds`: the GPU reaches the clocks it will hold, and the trend
    shows the drift a config timed first on a cold GPU would carry."""
    apply_config(run, "none")
    times: list[float] = []
    start = time.perf_counter()
    with gpu_sampled(run.cuda) as gpu:
        while time.perf_counter() - start < seconds or len(times) < 2:
            times.append(train_step(run, clock).fwd_bwd_s * 1e3)
    edge = max(1, min(5, len(times) // 2))
    return dict(
        seconds=round(time.perf_counter() - start, 1),
        fwd_bwd_ms=[round(t, 3) for t in times],
        first_ms=round(statistics.median(times[:edge]), 3),
        last_ms=round(statistics.median(times[-edge:]), 3),
        gpu=gpu,
    )


# ---- statistics ----------------------------------------------------------------------------------


def spread(values_ms: list[float]) -> dict[str, float]:
    q1, _, q3 = statistics.quantiles(values_ms, n=4)
    return dict(
        median=round(statistics.median(values_ms), 3),
        min=round(min(values_ms), 3),
        q1=round(q1, 3),
        q3=round(q3, 3),
        max=round(max(values_ms), 3),
    )


def config_summary(blocks: list[Block], name: str, flops: float) -> dict[str, Any]:
    mine = [b for b in blocks if b.config == name]
    fwd_bwd = [s.fwd_bwd_s * 1e3 for b in mine for s in b.steps]
    step = [s.step_s * 1e3 for b in mine for s in b.steps]
    peaks = [b.peak_bytes for b in mine if b.peak_bytes is not None]
    return dict(
        steps=len(fwd_bwd),
        fwd_bwd_ms=spread(fwd_bwd),
        step_ms=spread(step),
        tflops_fwd_bwd=round(flops / statistics.median(fwd_bwd) / 1e9, 1),
        tflops_step=round(flops / statistics.median(step) / 1e9, 1),
        round_medians_fwd_bwd_ms=[round(b.median_ms(), 3) for b in mine],
        wall_ms=round(statistics.median(s.wall_s for b in mine for s in b.steps) * 1e3, 3),
        peak_allocated_gib=round(max(peaks) / GIB, 3) if peaks else None,
        dynamo_frames_warmup=sum(b.compiles_warmup for b in mine),
        dynamo_frames_timed=sum(b.compiles_timed for b in mine),
        warnings=sorted({w for b in mine for w in b.warnings}),
    )


def versus_none(blocks: list[Block], name: str) -> dict[str, Any]:
    """The config's forward+backward time against none's: pooled medians, and round by round
    (blocks of one round ran next to each other). The noise band is how far none's own round
    medians spread; with one round there is none to measure and no verdict."""

    def rounds_of(config: str) -> dict[int, float]:
        return {b.round: b.median_ms() for b in blocks if b.config == config}

    def pooled(config: str) -> float:
        return statistics.median(s.fwd_bwd_s * 1e3 for b in blocks if b.config == config for s in b.steps)

    base, mine = rounds_of("none"), rounds_of(name)
    per_round = [100 * (mine[r] / base[r] - 1) for r in sorted(base) if r in mine]
    diff = 100 * (pooled(name) / pooled("none") - 1)
    noise = 100 * (max(base.values()) - min(base.values())) / pooled("none")
    same_sign = all(d > 0 for d in per_round) or all(d < 0 for d in per_round)
    return dict(
        diff_ms=round(pooled(name) - pooled("none"), 3),
        diff_pct=round(diff, 3),
        round_diffs_pct=[round(d, 3) for d in per_round],
        noise_pct=round(noise, 3),
        outside_noise=(same_sign and abs(diff) > noise) if len(base) > 1 else None,
    )


def summarize(blocks: list[Block], configs: tuple[str, ...], flops: float) -> dict[str, Any]:
    return dict(
        blocks=[
            dict(
                config=b.config,
                round=b.round,
                fwd_bwd_ms=[round(s.fwd_bwd_s * 1e3, 3) for s in b.steps],
                step_ms=[round(s.step_s * 1e3, 3) for s in b.steps],
                gpu=b.gpu,
            )
            for b in blocks
        ],
        configs={name: config_summary(blocks, name, flops) for name in configs},
        vs_none={name: versus_none(blocks, name) for name in configs if name != "none"},
    )


# ---- profile -------------------------------------------------------------------------------------

KernelTable = dict[str, tuple[int, float]]  # name -> (calls, microseconds)


def profile_step(run: Run, clock: Clock) -> tuple[KernelTable, float]:
    """One step under torch.profiler: GPU kernels with their calls and time (on CPU, aten ops with
    their self time), and the step's time."""
    activity = ProfilerActivity.CUDA if run.cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        took = train_step(run, clock)
    table: KernelTable = {}
    for event in prof.key_averages():
        us = event.device_time_total if run.cuda else event.self_cpu_time_total
        if us > 0:
            table[event.key] = (event.count, us)
    return table, took.step_s


def by_group_ms(table: KernelTable) -> dict[str, float]:
    groups: dict[str, float] = {}
    for name, (_, us) in table.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + us / 1e3
    return {g: round(ms, 3) for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])}


def extra_kernels(table: KernelTable, base: KernelTable) -> list[dict[str, Any]]:
    """Kernels the config launches more often than none: what its recompute adds."""
    extra = []
    for name, (calls, us) in table.items():
        base_calls, base_us = base.get(name, (0, 0.0))
        if calls > base_calls:
            extra.append(
                dict(
                    name=name[:160],
                    group=group_of(name),
                    calls=calls - base_calls,
                    us=round(us - base_us, 1),
                    us_per_call=round(us / calls, 1),
                )
            )
    return sorted(extra, key=lambda e: -e["us"])


def profile_configs(run: Run, clock: Clock, configs: tuple[str, ...], warmup: int) -> dict[str, Any]:
    tables: dict[str, tuple[KernelTable, float]] = {}
    for name in configs:
        apply_config(run, name)
        for _ in range(warmup):
            train_step(run, clock)
        tables[name] = profile_step(run, clock)
    base = tables["none"][0]
    base_groups = by_group_ms(base)
    result = {}
    for name, (table, step_s) in tables.items():
        kernel_ms = sum(us for _, us in table.values()) / 1e3
        groups = by_group_ms(table)
        extra = extra_kernels(table, base) if name != "none" else []
        result[name] = dict(
            step_ms=round(step_s * 1e3, 3),
            kernel_ms=round(kernel_ms, 3),
            idle_ms=round(step_s * 1e3 - kernel_ms, 3),  # the step's time no kernel ran (on CPU: Python)
            by_group_ms=groups,
            group_delta_vs_none_ms={
                g: round(groups.get(g, 0.0) - base_groups.get(g, 0.0), 3)
                for g in sorted(set(groups) | set(base_groups))
            },
            top=[
                dict(name=n[:160], group=group_of(n), calls=c, us=round(us, 1))
                for n, (c, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:15]
            ],
            extra_vs_none=extra,
            # what the added kernels take, to set beside the step time measured against none
            extra_kernel_ms=round(sum(e["us"] for e in extra) / 1e3, 3),
        )
    return result


# ---- main ----------------------------------------------------------------------------------------


def reference(run: Run, shape: Shape, device: str) -> tuple[float, dict[str, Any]]:
    """remat's bench harness on the same model with no recompute: its first step compiles the
    regions, its result gives the FLOPs of a step (as its TFLOP/s count them) and a harness
    number to set beside this script's loop."""
    spec = BenchSpec(
        recipe=shape.recipe,
        overrides=shape.overrides,
        micro_batch_size=shape.micro_batch,
        max_steps=6,
        warmup_steps=2,
        compile=True,
        device=device,
        optimizer=True,
    )
    result = run_bench(spec, None, model=run.model, name="none")
    if result.status != "ok" or result.step_time_s is None or result.tflops_per_gpu is None:
        raise SystemExit(f"the harness run ended {result.status}")
    flops = result.tflops_per_gpu * 1e12 * result.step_time_s
    peak = result.peak_allocated_bytes
    return flops, dict(
        step_ms=round(result.step_time_s * 1e3, 3),
        tflops_step=round(result.tflops_per_gpu, 1),
        peak_allocated_gib=round(peak / GIB, 3) if peak is not None else None,
        losses=result.losses,
    )


def save(result: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "layernorm_cost.json").write_text(json.dumps(result, indent=1) + "\n")


def print_verdict(summary: dict[str, Any], label: str) -> None:
    print(f"\n{label}: config, median fwd+bwd ms, TFLOP/s fwd+bwd, vs none (per round), noise band, real?")
    for name, stats in summary["configs"].items():
        versus = summary["vs_none"].get(name)
        line = f"  {name:<10} {stats['fwd_bwd_ms']['median']:9.3f} {stats['tflops_fwd_bwd']:7.1f}"
        if versus:
            line += (
                f"  {versus['diff_pct']:+6.2f}% {versus['round_diffs_pct']}  noise {versus['noise_pct']:.2f}%"
                f"  {versus['outside_noise']}"
            )
        print(line, flush=True)


def compiled_phase(
    shape: Shape,
    device: str,
    clock: Clock,
    rounds: int,
    steps: int,
    warmup: int,
    gpu_warmup_s: float,
    result: dict[str, Any],
) -> float:
    """Everything with compiled regions, recorded into `result` (saved after each part); returns
    the FLOPs of a step. The model and its optimizer state are freed when it returns."""
    run = build_run(shape, device, compiled=True)
    flops, result["harness_none"] = reference(run, shape, device)
    result["flops_per_step"] = flops
    result["gpu_warmup"] = gpu_warmup(run, clock, gpu_warmup_s)
    save(result)
    compiled = summarize(time_rounds(run, clock, CONFIGS, rounds, warmup, steps), CONFIGS, flops)
    result["compiled"] = compiled
    print_verdict(compiled, "compiled regions")
    save(result)
    compiled["profile"] = profile_configs(run, clock, CONFIGS, warmup)
    for name, prof in compiled["profile"].items():
        print(
            f"profile {name:<10} step {prof['step_ms']:.2f} ms, kernels {prof['kernel_ms']:.2f} ms, added "
            f"{prof['extra_kernel_ms']:.3f} ms: {[(e['name'][:50], e['calls'], e['us']) for e in prof['extra_vs_none'][:4]]}",
            flush=True,
        )
    save(result)
    return flops


def eager_phase(
    shape: Shape, device: str, clock: Clock, steps: int, warmup: int, flops: float, result: dict[str, Any]
) -> None:
    """One round of none and layernorm without compiled regions (torch's RMSNorm and eager code
    between the Sites), for contrast."""
    run = build_run(shape, device, compiled=False)
    eager = summarize(time_rounds(run, clock, EAGER_CONFIGS, 1, warmup, steps), EAGER_CONFIGS, flops)
    result["eager"] = eager
    print_verdict(eager, "eager (no compiled regions), one round")
    save(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="llama3_tiny on CPU, 2 rounds of 3 steps")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the compiled configs (default 3)")
    parser.add_argument("--steps", type=int, help="timed steps per config and round, at least 2 (default 20)")
    parser.add_argument("--warmup", type=int, help="untimed steps after switching config (default 2)")
    parser.add_argument("--gpu-warmup-s", type=float, help="no-recompute steps before timing, seconds (default 20)")
    args = parser.parse_args()
    shape, device = SHAPES["tiny" if args.tiny else "70b"], "cpu" if args.tiny else "cuda"
    rounds = args.rounds or (2 if args.tiny else 3)
    steps = args.steps or (3 if args.tiny else 20)
    warmup = args.warmup or (1 if args.tiny else 2)
    gpu_warmup_s = args.gpu_warmup_s if args.gpu_warmup_s is not None else (0.5 if args.tiny else 20.0)
    if steps < 2:
        parser.error("--steps must be at least 2 (the spread needs quartiles)")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny on CPU")

    result: dict[str, Any] = dict(
        gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="PYTHONPATH=src python " + shlex.join(sys.argv),
        shape=dict(recipe=shape.recipe, overrides=shape.overrides, micro_batch=shape.micro_batch, dtype="bf16"),
        settings=dict(rounds=rounds, steps=steps, warmup=warmup, gpu_warmup_s=gpu_warmup_s),
    )
    clock = Clock(device == "cuda")
    start = time.perf_counter()
    flops = compiled_phase(shape, device, clock, rounds, steps, warmup, gpu_warmup_s, result)
    gc.collect()  # the compiled phase's model and optimizer state go before the eager one's come
    if device == "cuda":
        torch.cuda.empty_cache()
    eager_phase(shape, device, clock, steps, warmup, flops, result)
    result["seconds"] = round(time.perf_counter() - start, 1)
    save(result)
    print(f"\nwrote {OUT / 'layernorm_cost.json'} after {result['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
