"""Run by tests/integration/test_context_parallel_runs.py under torchrun (gloo, CPU). With 2
processes: remat's tiny Llama built by `build_model` with -cp 2 (torch's ring attention over the two
ranks, FSDP2 over the flattened dp x cp mesh), one step of 2 micro-batches on the step's mock data:
every plan with hidden dropout, and no recompute without dropout (pretrain, and SFT whose masked
prompt leaves the ranks unequal shares of labelled tokens); the MoE recipes (moe_tiny; deepseek_tiny
with MLA) in float64 under each plan, then the balancing step. With 4: -cp 2 beside -tp 2, sequence
parallelism off and on, in float64: the plans with hidden dropout and none without, each rank's
hidden dropout masks, the MoE recipes, a refusal and a bench run; and -cp 2 beside -pp 2
(cp_pp_results). With 8 (a slow test): pp 2 x cp 2 x tp 2. Rank 0 saves the mean loss, the full
gradients and expert biases of each, each rank's share of a sequence, the bench runs and the
refusals to the file argv[1]."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import fsdp_worker  # the plans of the FSDP2 tests
import gloo
import moe_worker  # MoE recompute modules, names in the whole model
import torch
import torch.distributed as dist
import tp_worker  # its dropout recorder
from torch.distributed.device_mesh import init_device_mesh

import remat
from remat import parallel
from remat.bench.run import run_bench
from remat.bench.spec import BenchSpec
from remat.config.parallel import ParallelLayout
from remat.config.plan import Plan
from remat.config.precision import Precision
from remat.config.recompute import RecomputeConfig
from remat.core.problems import ConfigError
from remat.models.llama.parallel import gate_up_by_rank
from remat.parallel.tensor_parallel import parallelize_tensor
from remat.run.build import apply_plan, build_model
from remat.run.spec import RunSpec
from remat.run.step import MockData, forward_backward
from remat.sites.calls import after_optimizer_step, forward_loss

CP, TP, PP, SEQ, MICRO_BATCHES = 2, 2, 2, 16, 2
MOE, MOE_PLANS = ("moe_tiny", "deepseek_tiny"), ("none", "selective", "full_uniform_1")
MOE_TP = (("moe_tiny", "none", False), ("deepseek_tiny", "none", True), ("deepseek_tiny", "selective", True))
PLANS: dict[str, RecomputeConfig | Plan | None] = {
    **fsdp_worker.PLANS,
    "core_attn": RecomputeConfig(recompute_granularity="selective", recompute_modules=["core_attn"]),
}
# beside tensor parallelism: Megatron's selective recompute of attention and the MLP, and full
# recompute of two-layer ranges (each replay runs the ring of both layers again)
CP_TP_PLANS: dict[str, RecomputeConfig | None] = {
    "none": None,
    "selective": RecomputeConfig(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
    "full": fsdp_worker.full("uniform", 2),
}


def spec(
    dropout: float = 0.0,
    task: str = "pretrain",
    context_parallel: int = CP,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    compute_dtype: str = "fp32",
    recipe: str = "llama3_tiny",
    pipeline: tuple[int, int | None] = (1, None),
    **more: Any,
) -> RunSpec:
    """4 layers, attention through SDPA; fp32 by default (torch's ring merges its blocks in fp32);
    `pipeline`: pp and vp."""
    layout = ParallelLayout(
        cp=context_parallel,
        tp=tensor_parallel,
        sp=sequence_parallel,
        pp=pipeline[0],
        vp=pipeline[1],
        num_gpus=context_parallel * tensor_parallel * pipeline[0],
    )
    return RunSpec(
        recipe=recipe,
        overrides=dict(num_layers=fsdp_worker.LAYERS, seq_length=SEQ, hidden_dropout=dropout),
        precision=Precision(compute_dtype),
        device="cpu",
        task=task,
        optimizer=False,
        global_batch_size=MICRO_BATCHES,
        layout=layout,
        **more,
    )


def moe_spec(recipe: str, context_parallel: int = CP, pipeline: tuple[int, int | None] = (1, None)) -> RunSpec:
    """An MoE recipe in float64 (its routing then agrees with one process's despite the ring's sums)."""
    return spec(recipe=recipe, context_parallel=context_parallel, compute_dtype="fp64", pipeline=pipeline)


def cp_tp_spec(sp: bool, dropout: float = 0.0) -> RunSpec:
    return spec(dropout, tensor_parallel=TP, sequence_parallel=sp, compute_dtype="fp64")


# the loss averaged over the ranks; the full gradients and an MoE's expert biases after the
# balancing step, named as in the whole model (a tuple: torch.load's weights_only takes it)
Step = tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]


def step(run: RunSpec, plan: object) -> Step:
    """One step of `run` under `plan` and the balancing step after it, an MoE router's expert bias
    drawn at random first (routing then depends on it, as in the MoE pipeline tests)."""
    model = build_model(run)  # weights from the seed, before FSDP2 shards them
    if isinstance(model, parallel.Pipeline):  # each stage drew from a seed of its own: one process's instead
        torch.manual_seed(run.seed)
        whole = moe_worker.state(run.family.build(run.model_config, dtype=run.state_dtype))
        if (tp := run.layout.tp) > 1:  # as tensor parallelism stores them
            for name in [name for name in whole if name.endswith("mlp.linear_fc1.weight")]:
                gate_up_by_rank(whole[name], tp)
        for chunk in model.chunks:
            moe_worker.load(chunk, whole)
    for chunk in parallel.model_chunks(model):
        for layer, name in moe_worker.global_names(chunk):
            if name.endswith("expert_bias"):
                bias = chunk.get_buffer(layer)
                g = torch.Generator().manual_seed(int(name.split(".")[2]))  # decoder.layers.N...
                bias.copy_(0.5 * torch.randn(bias.shape, generator=g, dtype=bias.dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        apply_plan(run, model, plan)  # type: ignore[arg-type]
    loss = parallel.mean_over_ranks(forward_backward(model, MockData(run), run.micro_batches))
    after_optimizer_step(model)
    found: dict[str, dict[str, torch.Tensor]] = {"grads": {}, "bias": {}}
    shapes = {name: p.shape for name, p in run.family.build(run.model_config, device="meta").named_parameters()}
    for chunk in parallel.model_chunks(model):
        own = moe_worker.state(chunk)
        for local, name in moe_worker.global_names(chunk):
            if name.endswith("expert_bias"):
                found["bias"][name] = own[local].clone()
            elif (grad := own[local].grad) is not None:
                found["grads"][name] = whole_grad(run, getattr(grad, "full_tensor", lambda: grad)(), shapes[name])
    if isinstance(model, parallel.Pipeline):  # each pipeline rank holds its stages'
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, found)
        found = {key: {k: v for ranks in every for k, v in ranks[key].items()} for key in found}
    return loss.item(), found["grads"], found["bias"]


def whole_grad(run: RunSpec, grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A gradient whole: an MoE expert weight's from this rank's slice of each expert's FFN, the
    slices of its tensor-parallel group (adjacent ranks) joined along the dimension they split."""
    if grad.shape == shape:
        return grad
    tp = run.layout.tp
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, grad)
    first = dist.get_rank() // tp * tp
    return torch.cat(every[first : first + tp], next(d for d, (a, b) in enumerate(zip(grad.shape, shape)) if a != b))


def shares() -> list[list[int]]:
    """Each rank's positions of a sequence: torch's head-tail chunks (0 and 3 of 4, 1 and 2)."""
    run = spec()
    model = build_model(run)
    positions = torch.arange(SEQ)[None]
    with parallel.sharded(model, [(positions, positions.clone())]):
        mine = positions[0].tolist()
    found: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(found, mine)
    return found


def refusal(fn: Any) -> list[str]:
    try:
        fn()
    except (ConfigError, ValueError) as err:
        return [str(err)]
    return []


def refusals() -> dict[str, list[str]]:
    cp_mesh = init_device_mesh("cpu", (CP,))
    two_d = init_device_mesh("cpu", (1, CP), mesh_dim_names=("dp", "cp"))
    eager = remat.models.build("llama3_tiny", attention_backend="eager", attention_dropout=0.1, seq_length=SEQ)
    short = build_model(spec())
    ids = torch.zeros(1, SEQ // 2, dtype=torch.long)
    return {
        "mesh": refusal(lambda: parallel.context_parallel_model(fsdp_worker.model(0.0), two_d)),
        "model": refusal(lambda: parallel.context_parallel_model(eager, cp_mesh)),
        "short": refusal(lambda: parallel.sharded(short, [(ids, ids.clone())]).__enter__()),
    }


def hidden_masks(sp: bool) -> list[list[torch.Tensor]]:
    """Every rank's hidden dropout masks (embedding's and layers') in one forward."""
    run = cp_tp_spec(sp, dropout=0.1)
    model, (input_ids, labels) = build_model(run), MockData(run).batch()
    torch.manual_seed(run.seed)
    with parallel.sharded(model, [(input_ids, labels)]), tp_worker.DropoutMasks() as recorded:
        forward_loss(model, input_ids, labels)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, [dropped for dropped, _ in recorded.masks])
    return every


def bench(tensor_parallel: int = 1, pipeline: int = 1) -> tuple[str, list[float]]:
    """remat bench's run on this torchrun's ranks (what `remat bench -cp 2 [-tp 2 | -pp 2] -ng N`
    runs; 2 micro-batches, as 1F1B over 2 stages needs)."""
    layout = ParallelLayout(cp=CP, tp=tensor_parallel, pp=pipeline, num_gpus=CP * tensor_parallel * pipeline)
    result = run_bench(
        BenchSpec(
            recipe="llama3_tiny",
            overrides=dict(num_layers=2),
            precision=Precision("fp32"),
            device="cpu",
            max_steps=2,
            warmup_steps=1,
            global_batch_size=MICRO_BATCHES,
            layout=layout,
        ),
        RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    )
    return result.status, result.losses or []


def results() -> dict[str, object]:
    found: dict[str, object] = {f"{name}@0.1": step(spec(0.1), plan) for name, plan in PLANS.items()}
    found |= {f"{task}:none": step(spec(task=task), None) for task in ("pretrain", "sft")}
    # Megatron's selective recompute of attention and the MoE layer (MLA's up projections too),
    # and full recompute of single layers: each replays the ring and the router's reduction
    found |= {
        f"{recipe}:{name}": step(moe_spec(recipe), moe_worker.plan(recipe, name))
        for recipe in MOE
        for name in MOE_PLANS
    }
    found["shares"] = shares()
    found["refusals"] = refusals()
    found["bench"] = bench()
    return found


def sequence_split_refusal() -> list[str]:
    """context_parallel_model on a model split over 4 ranks with sequence parallelism, each cp
    rank's 10 of 20 tokens too few to split over them."""
    torch.manual_seed(0)
    model = remat.models.build("llama3_tiny", num_query_groups=4, seq_length=20)
    parallelize_tensor(model, init_device_mesh("cpu", (dist.get_world_size(),)), sequence_parallel=True)
    cp_mesh = init_device_mesh("cpu", (CP, dist.get_world_size() // CP), mesh_dim_names=("cp", "other"))["cp"]
    return refusal(lambda: parallel.context_parallel_model(model, cp_mesh))


def cp_tp_results() -> dict[str, object]:
    found: dict[str, object] = {
        f"{name}@sp={sp}@0.1": step(cp_tp_spec(sp, 0.1), plan)
        for sp in (False, True)
        for name, plan in CP_TP_PLANS.items()
    }
    found |= {f"none@sp={sp}@0.0": step(cp_tp_spec(sp), None) for sp in (False, True)}
    found |= {f"masks@sp={sp}": hidden_masks(sp) for sp in (False, True)}
    # the MoE recipes split as by tensor parallelism alone (router replicated on the tp group's
    # tokens, experts' FFN by rank), selective recompute replaying the ring and the MoE's collectives
    found |= {
        f"{recipe}:{name}@sp={sp}": step(
            spec(recipe=recipe, tensor_parallel=TP, sequence_parallel=sp, compute_dtype="fp64"),
            moe_worker.plan(recipe, name),
        )
        for recipe, name, sp in MOE_TP
    }
    found["sequence split"] = sequence_split_refusal()
    found["bench"] = bench(TP)
    # experts over the 2 data-parallel ranks beside cp 2: the same step as without expert parallelism
    found |= {
        f"ep:{ep}:{name}": ep_cp_step("moe_tiny", ep, moe_worker.plan("moe_tiny", name))
        for ep, name in ((1, "none"), (2, "none"), (2, "selective"))
    }
    return found | cp_pp_results()


def ep_cp_step(
    recipe: str, ep: int, plan: object
) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One step of the MoE recipe over dp 2 x cp 2 (float64), its experts split over the 2
    data-parallel ranks with `ep` 2: the loss, every gradient whole (an expert weight's gathered
    from its expert-parallel group), the expert biases after the balancing step, and how many
    experts each MoE layer holds on this rank."""
    base = spec(recipe=recipe, compute_dtype="fp64")
    run = dataclasses.replace(base, layout=dataclasses.replace(base.layout, num_gpus=CP * 2, ep=ep))
    model = build_model(run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        apply_plan(run, model, plan)  # type: ignore[arg-type]
    loss = parallel.mean_over_ranks(forward_backward(model, MockData(run), run.micro_batches))
    after_optimizer_step(model)
    grads = {name: moe_worker.whole_grad(model, name, p.grad) for name, p in model.named_parameters()}
    held = {name: torch.tensor(p.shape[0]) for name, p in model.named_parameters() if name.endswith("experts.weight1")}
    return loss.item(), grads, {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}, held


def cp_pp_results() -> dict[str, object]:
    """-cp 2 beside -pp 2 (1F1B; interleaved with 2 virtual stages), float64: every plan with
    hidden dropout, and without dropout pretrain and SFT (unequal shares of labelled tokens); the
    MoE recipes without recompute and with full recompute of single layers."""

    def pp_spec(vp: int | None = None, **kwargs: Any) -> RunSpec:
        return spec(compute_dtype="fp64", pipeline=(PP, vp), **kwargs)

    found: dict[str, object] = {
        f"pp:{name}@0.1": step(pp_spec(dropout=0.1), plan) for name, plan in CP_TP_PLANS.items()
    }
    found |= {f"pp:{task}": step(pp_spec(task=task), None) for task in ("pretrain", "sft")}
    found["pp:interleaved"] = step(pp_spec(vp=2, task="sft"), None)
    found |= {
        f"pp:{recipe}:{name}": step(moe_spec(recipe, pipeline=(PP, None)), moe_worker.plan(recipe, name))
        for recipe in MOE
        for name in ("none", "full_uniform_1")
    }
    found["pp:bench"] = bench(pipeline=PP)
    return found


def cp_pp_tp_results() -> dict[str, object]:
    """pp 2 x cp 2 x tp 2, SFT in float64: sequence parallelism off and on, and full recompute."""

    def run(sp: bool) -> RunSpec:
        return spec(task="sft", tensor_parallel=TP, sequence_parallel=sp, compute_dtype="fp64", pipeline=(PP, None))

    return {f"sp={sp}": step(run(sp), None) for sp in (False, True)} | {"full": step(run(True), CP_TP_PLANS["full"])}


if __name__ == "__main__":
    gloo.run(lambda: {CP: results, CP * TP: cp_tp_results, PP * CP * TP: cp_pp_tp_results}[dist.get_world_size()]())
