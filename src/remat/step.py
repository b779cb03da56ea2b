"""One training step, as every measurement in remat runs it: the model of a recipe, mock data, the
optimizer, micro-batches. `remat bench` times it, `remat.trace` and `remat plan` measure it,
`remat estimate` runs it on shapes alone, and `RunSpec` spells its settings once for all of them.

A step is Megatron's iteration: global_batch_size / (micro_batch_size x data parallel)
micro-batches of forward and backward (gradients accumulate), then an AdamW step.
"""
from __future__ import annotations

import dataclasses
import gc
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from remat import models
from remat import parallel
from remat.apply import apply, find_sites
from remat.calls import forward_loss, set_loss_scale
from remat.layer_plan import Plan, PlanLike
from remat.layout import check_config
from remat.optimizer import DTYPES, OptimizerPrecision, adamw, make as make_step_optimizer
from remat.memory.measure import trace
from remat.memory.meter import local_tensor
from remat.memory.prediction import Trace
from remat.models import ModelConfig, ModelFamily, ParallelSizes
from remat.parallel.pipeline import Pipeline, PipelineLayout, model_chunks
from remat.parallel.tensor_parallel import distribute_saved_inputs, parallelize_tensor
from remat.problems import ConfigError, Problem, count, did_you_mean, one_of, raise_if_any
from remat.recompute import RecomputeConfig, TrainingFacts
from remat.rules import MIN_OFFLOADED_TENSOR_SIZE

COMPUTE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
# Megatron Bridge's compute dtypes; those remat does not run yet are refused by name.
BRIDGE_COMPUTE_DTYPES: tuple[str, ...] = ("bf16", "fp8_cs", "fp8_mx", "fp8_sc", "nvfp4")
TASKS: tuple[str, ...] = ("pretrain", "sft")
BRIDGE_TASKS: tuple[str, ...] = ("pretrain", "sft", "peft")
# Tokens of one micro-batch on one GPU: 2^22 of a 4096-wide bf16 hidden state are 32 GiB a layer,
# past what a GPU trains; the shapes-only trace of far more loops for hours.
MAX_TOKENS_PER_GPU = 1 << 22
# Micro-batches a step accumulates on one rank: far past what Megatron runs (thousands at most).
MAX_MICRO_BATCHES = 1 << 16
# GPUs of one run: ten times the largest jobs trained.
MAX_GPUS = 1 << 20
# Megatron's expert-parallel sizes: keys of a config whose model routes experts (remat's MoE).
EXPERT_SIZES: tuple[str, ...] = ("expert_model_parallel_size", "expert_tensor_parallel_size")


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class RunSpec:
    """The step to run: a recipe with overrides (Megatron's model keys), batch, precision, kernels.
    Validated on creation: every problem at once."""

    recipe: str = "llama3_tiny"
    overrides: Mapping[str, Any] = field(default_factory=dict)
    micro_batch_size: int = 1
    # sequences per step over all data-parallel ranks; None: one micro-batch per rank
    global_batch_size: int | None = None
    num_gpus: int | None = None  # None: one copy of the model (tp x pp x cp GPUs), no data parallelism
    compute_dtype: str = "bf16"
    device: str = field(default_factory=_default_device)
    compile: bool = False  # the model's code between Sites compiled, its fast kernels on the device
    optimizer: bool = True  # False: forward+backward only, gradients accumulating (as the torch anchor)
    task: str = "pretrain"  # "sft" masks the first quarter of each sequence's labels (the prompt)
    seed: int = 1234
    precision: OptimizerPrecision = field(default_factory=OptimizerPrecision)
    # the parallel layout in Megatron's sizes (tp, sp, pp, vpp, cp) and what the rules read of the run
    facts: TrainingFacts = field(default_factory=TrainingFacts)

    def __post_init__(self) -> None:
        raise_if_any(self.problems())

    def problems(self) -> Iterator[Problem]:
        """What is wrong with these settings (a subclass adds its own)."""
        config = None
        expert_sizes = list(self._expert_size_problems())
        yield from expert_sizes
        try:
            if not expert_sizes:  # else the config would also call them unknown overrides
                config = self.model_config
        except ConfigError as err:
            yield from err.problems
        except ValueError as err:  # an unknown recipe or override
            yield Problem("model_recipe_name", str(err))
        yield from _dtype_problems(self.compute_dtype)
        yield from _task_problems(self.task)
        yield from self.precision.problems()
        yield from self._device_problems()
        yield from self._batch_problems()
        if config is not None:
            yield from micro_batch_tokens_problems(config.seq_length, self.micro_batch_size, self.context_parallel)
            yield from self._layout_problems(config)

    def _layout_problems(self, config: ModelConfig) -> Iterator[Problem]:
        """The recompute rules' checks of the parallel sizes and the family's of its shard."""
        try:
            RecomputeConfig(facts=dataclasses.replace(self.facts, num_layers=config.num_layers))
        except ConfigError as err:
            yield from err.problems
        yield from self.family.shard_problems(config, self.parallel)
        if self.context_parallel > 1:
            yield from self.family.context_parallel_problems(config, self.parallel)
        ep = expert_parallel_size(config)
        if ep > 1 and self.num_gpus is not None and self.data_parallel % ep:
            yield Problem("expert_model_parallel_size", f"({ep}) does not divide the {self.data_parallel} data-parallel"
                                                        f" rank(s) (-ng {self.num_gpus} / tp x pp x cp"
                                                        f" {self.model_parallel}); expert-parallel ranks are"
                                                        " data-parallel ranks that split the experts: use -ng a"
                                                        f" multiple of {self.model_parallel * ep}")

    def _expert_size_problems(self) -> Iterator[Problem]:
        """-ep or -etp for a recipe whose model has no routed experts to split."""
        given = [key for key in EXPERT_SIZES if key in self.overrides]
        try:
            base = models.recipe_config(self.recipe) if given else None
        except (ConfigError, ValueError):  # the recipe's own problem, reported with the config
            return
        for key in given:
            if not hasattr(base, key):
                yield Problem(key, f"is {self.overrides[key]}, but {self.recipe} has no routed experts that remat"
                                   " splits; use an MoE recipe (remat recipes lists them) or drop it")
            elif key == EXPERT_SIZES[1] and self.overrides[key] == 1 and self.facts.tensor_model_parallel_size > 1:
                # the config's 1 is remat's unset; given beside tp, it asks for experts whole on each tp rank
                yield Problem(key, "is 1, experts whole on every tensor-parallel rank, which does not run yet;"
                                   " beside -tp remat splits each expert over the tensor-parallel ranks as"
                                   " Megatron's default (etp = tp) does: drop -etp")

    def _device_problems(self) -> Iterator[Problem]:
        yield from _device_name_problems(self.device)

    def _batch_problems(self) -> Iterator[Problem]:
        yield from micro_batch_problems(self.micro_batch_size)
        if self.num_gpus is None:  # one copy of the model
            yield from self._global_batch_problems()
        elif self.num_gpus > MAX_GPUS:
            yield Problem("num_gpus", f"is {self.num_gpus:,}; remat plans for at most {MAX_GPUS:,} GPUs")
        elif self.num_gpus < 1:
            yield Problem("num_gpus", f"is {self.num_gpus}; use at least {max(self.model_parallel, 1)}"
                                      " (tp x pp x cp)")
        elif self.num_gpus % self.model_parallel:
            yield Problem("num_gpus", f"{count(self.num_gpus, 'GPU')} {'does' if self.num_gpus == 1 else 'do'} not split into data-parallel groups of tp x pp x cp"
                                      f" = {self.model_parallel}; use a multiple of {self.model_parallel}")
        else:
            yield from self._global_batch_problems()

    def _global_batch_problems(self) -> Iterator[Problem]:
        if self.global_batch_size is not None and self.micro_batch_size >= 1:
            per_step = self.micro_batch_size * self.data_parallel
            of = (f"the micro-batch size {per_step}" if self.data_parallel == 1
                  else f"micro-batch x data parallel = {per_step}")
            if self.global_batch_size < per_step or self.global_batch_size % per_step:
                yield Problem("global_batch_size", f"{self.global_batch_size} is not a positive multiple of {of};"
                                                   " use a multiple of it")
            elif self.global_batch_size // per_step > MAX_MICRO_BATCHES:
                yield Problem("global_batch_size", f"{self.global_batch_size:,} makes {self.global_batch_size // per_step:,}"
                                                   f" micro-batches a step; remat runs at most {MAX_MICRO_BATCHES:,}:"
                                                   " lower -gb or raise -mb")

    @property
    def family(self) -> ModelFamily:
        return models.family_of(self.recipe)

    @property
    def model_config(self) -> ModelConfig:
        return models.recipe_config(self.recipe, **self.overrides)

    @property
    def dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.compute_dtype]

    @property
    def parallel(self) -> ParallelSizes:
        return parallel_sizes(self.facts)

    @property
    def model_parallel(self) -> int:
        """GPUs one copy of the model spans (tp x pp x cp)."""
        return self.facts.model_parallel_size

    @property
    def expert_parallel(self) -> int:
        """Ranks each MoE layer's routed experts split over (Megatron's expert_model_parallel_size)."""
        return expert_parallel_size(self.model_config)

    @property
    def context_parallel(self) -> int:
        return self.facts.context_parallel_size

    @property
    def stages(self) -> int:
        return self.facts.pipeline_model_parallel_size

    @property
    def pipeline(self) -> PipelineLayout:
        return PipelineLayout(self.stages, self.facts.virtual_pipeline_model_parallel_size or 1)

    @property
    def data_parallel(self) -> int:
        return 1 if self.num_gpus is None else max(self.num_gpus // self.model_parallel, 1)

    @property
    def fully_sharded(self) -> bool:
        """Whether FSDP2 shards the training state over the dp x cp ranks: in every run with data
        or context parallelism (remat's data parallelism is FSDP2)."""
        return self.data_parallel * self.context_parallel > 1

    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype parameters are kept in: under FSDP2 with main parameters, theirs (FSDP2
        gathers them in the compute dtype); otherwise the compute dtype."""
        main = self.precision.main_params_dtype
        return DTYPES[main] if self.fully_sharded and main is not None else self.dtype

    @property
    def micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs a step."""
        per_step = self.micro_batch_size * self.data_parallel
        if self.global_batch_size is None or per_step < 1:  # a size below 1 is its own problem
            return 1
        return max(self.global_batch_size // per_step, 1)


def parallel_sizes(facts: TrainingFacts) -> ParallelSizes:
    """The parallel layout of Megatron's settings, as a model family reads it."""
    return ParallelSizes(facts.tensor_model_parallel_size, facts.sequence_parallel,
                         facts.pipeline_model_parallel_size, facts.context_parallel_size)


def expert_parallel_size(config: ModelConfig) -> int:
    """A config's expert_model_parallel_size; 1 for a model without routed experts."""
    return int(getattr(config, EXPERT_SIZES[0], 1))


def expert_parallel_run_problems(spec: RunSpec) -> Iterator[Problem]:
    """What a run that splits the experts needs beyond what an estimate of one of its ranks does:
    a process for each expert-parallel rank, and a model the family can split."""
    ep = spec.expert_parallel
    if ep == 1:
        return
    if spec.num_gpus is None:
        yield Problem("num_gpus", f"is not given, so this runs one copy of the model on tp x pp x cp ="
                                  f" {spec.model_parallel} GPU(s); -ep {ep} splits the experts over {ep}"
                                  f" data-parallel ranks: use -ng {spec.model_parallel * ep}")
    yield from spec.family.expert_parallel_problems(spec.family.build(spec.model_config, device="meta"), ep)


def _dtype_problems(dtype: str) -> Iterator[Problem]:
    if dtype not in COMPUTE_DTYPES:
        known = dtype in BRIDGE_COMPUTE_DTYPES
        # a typo is pointed at what runs, not at a Bridge dtype that would be refused next
        yield Problem("compute_dtype", f"{dtype!r} is " + (
            "not supported yet" if known else
            f"not a compute dtype{did_you_mean(dtype, COMPUTE_DTYPES)}; Megatron Bridge's "
            f"are {one_of(BRIDGE_COMPUTE_DTYPES)}") + "; use -c bf16")


def _task_problems(task: str) -> Iterator[Problem]:
    if task not in TASKS:
        yield Problem("task", f"{task!r} is " + (
            "not supported yet" if task in BRIDGE_TASKS else
            f"not a task{did_you_mean(task, TASKS)}; Megatron Bridge's are {one_of(BRIDGE_TASKS)}")
            + f"; use {' or '.join(TASKS)}")


def _device_name_problems(device: str) -> Iterator[Problem]:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        yield Problem("device", f"{device!r} is not a device; use cpu, cuda or cuda:N")


def device_problems(device: str) -> list[Problem]:
    """A device a step runs on: cpu, cuda or cuda:N, and a GPU where one is asked for."""
    problems = list(_device_name_problems(device))
    if not problems and device.startswith("cuda") and not torch.cuda.is_available():
        problems.append(Problem("device", "a CUDA GPU was asked for but this machine has none; run on CPU with a"
                                          " tiny recipe (remat recipes lists it)"))
    return problems


def micro_batch_problems(micro_batch_size: int) -> Iterator[Problem]:
    if micro_batch_size < 1:
        yield Problem("micro_batch_size", f"is {micro_batch_size}; use at least 1")


def micro_batch_tokens_problems(seq_length: int, micro_batch_size: int, context_parallel_size: int) -> Iterator[Problem]:
    tokens = seq_length * micro_batch_size // max(context_parallel_size, 1)
    if tokens > MAX_TOKENS_PER_GPU:
        yield Problem("seq_length", f"{seq_length} x micro-batch {micro_batch_size} over {context_parallel_size}"
                                    f" context-parallel rank(s) puts {tokens:,} tokens on each GPU; remat"
                                    f" runs at most {MAX_TOKENS_PER_GPU:,} (2^22: at hidden size 4096 their"
                                    f" hidden state alone is 32 GiB a layer); lower -sl or -mb, or raise -cp")


def single_process_problems(facts: TrainingFacts) -> Iterator[Problem]:
    """What the recompute rules accept but a one-process step (verify) does not run."""
    for name, size in (("tensor_model_parallel_size", facts.tensor_model_parallel_size),
                       ("pipeline_model_parallel_size", facts.pipeline_model_parallel_size),
                       ("context_parallel_size", facts.context_parallel_size)):
        if size != 1:
            yield Problem(name, f"is {size}; this runs one process, without model parallelism; use 1 (remat bench"
                                " runs it under torchrun)")
    if facts.virtual_pipeline_model_parallel_size is not None:
        yield Problem("virtual_pipeline_model_parallel_size", "needs pipeline parallelism, which this run"
                                                              " does not execute; drop -vp")
    yield from unrun_problems(facts)


def unrun_problems(facts: TrainingFacts) -> Iterator[Problem]:
    """What the recompute rules accept but remat does not run yet (remat estimate predicts it)."""
    if facts.cuda_graph_impl != "none" or facts.cuda_graph_scope:
        yield Problem("cuda_graph_impl", "this runs without CUDA graphs; drop --cuda_graph_impl and"
                                         " --cuda_graph_scope")


def available_host_bytes() -> int | None:
    """Memory this process can still allocate on the host: the kernel's MemAvailable, within the
    container's limit where one is set; None where neither can be read."""
    found: list[int] = []
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        found.append(int(meminfo["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def build_model(spec: RunSpec) -> nn.Module:
    """The spec's model on its device, from the spec's seed, with its kernels. Under torchrun, on
    a pp x dp x cp x tp mesh: this rank's pipeline stages (a `Pipeline`) when pp > 1, each split
    by tensor parallelism when tp > 1, running its share of each sequence when cp > 1, its
    routed experts split by expert parallelism when ep > 1 (over the dp ranks of its own
    pipeline rank), and sharded with FSDP2 over the data- and context-parallel ranks when there
    are several."""
    if parallel.world_size() == 1:
        if spec.model_parallel > 1:
            raise ConfigError([Problem("num_gpus", f"tp x pp x cp = {spec.model_parallel} needs as many processes;"
                                                   f" launch with torchrun, or let remat bench start it")])
        return _build_chunk(spec, spec.model_config, 0)
    mesh = parallel.device_mesh(spec.device, spec.stages, spec.data_parallel, spec.facts.tensor_model_parallel_size,
                                spec.context_parallel)
    layout, config = spec.pipeline, spec.model_config
    pipeline_rank = mesh["pp"].get_local_rank()
    chunks = [_build_chunk(spec, stage_config(spec, index) if spec.stages > 1 else config, index, mesh)
              for index in layout.stage_indices(pipeline_rank)]
    if spec.stages == 1:
        return chunks[0]
    # the hidden states a stage sends its next: this rank's tokens, to the same cp and tp rank of it
    split = spec.parallel.sequence_split * spec.context_parallel
    hidden = torch.empty(spec.micro_batch_size, config.seq_length // split, config.hidden_size, dtype=spec.dtype,
                         device="meta")
    return Pipeline(chunks, layout, pipeline_rank=pipeline_rank, hidden=hidden, micro_batches=spec.micro_batches,
                    group=mesh["pp"].get_group())


def stage_config(spec: RunSpec, stage: int) -> ModelConfig:
    """Pipeline stage `stage`'s share of the spec's model: its layers, numbered as in the whole
    model (a layer's kind and seeds follow that number)."""
    layout, config = spec.pipeline, spec.model_config
    layers = tuple(layout.layers(config.num_layers, stage))
    return spec.family.shard(config, ParallelSizes(pipeline=layout.chunks, layers=layers))


def _build_chunk(spec: RunSpec, config: ModelConfig, stage: int, mesh: DeviceMesh | None = None) -> nn.Module:
    """Pipeline stage `stage` of the spec's model (the whole model without pipelining), seeded by
    its index (alike on its tensor-parallel ranks): the first with the embedding, the last with
    the loss head; on `mesh`, split over its tp ranks, its sequences over its cp ranks, its
    routed experts over groups of ep of its dp ranks, and sharded over its dp x cp ranks (each
    cp rank's gradients are of its own tokens), which the family is told hold its replicas."""
    torch.manual_seed(spec.seed + stage)
    family, last = spec.family, spec.pipeline.chunks - 1
    model = family.build(config, dtype=spec.state_dtype, device=spec.device, pre_process=stage == 0,
                         post_process=stage == last)
    if spec.compile:
        family.use_kernels(model, "cuda" if spec.device.startswith("cuda") else "cpu", compiled=True)
    if mesh is None:
        return model
    context = spec.context_parallel > 1
    # torchtitan's flattened dp x cp dimension: the replicas of this rank's model
    replicas = mesh["dp", "cp"]._flatten() if context else mesh["dp"]
    # each rank draws its experts whole, before tensor parallelism splits their FFN
    experts = parallel.split_experts(model, mesh["dp"], spec.expert_parallel,
                                     context=(mesh, replicas) if context else None) if spec.expert_parallel > 1 else None
    if spec.facts.tensor_model_parallel_size > 1:
        parallelize_tensor(model, mesh["tp"], sequence_parallel=spec.facts.sequence_parallel)
    if context:
        parallel.context_parallel_model(model, mesh["cp"])
    if not spec.fully_sharded:
        return model
    family.data_parallel(model, replicas.get_group())
    compute, reduce = fsdp2_precision(spec)
    # Megatron's distributed optimizer: layers whole through a step, gradients reduced once
    once = spec.precision.use_distributed_optimizer
    if experts is not None:  # FSDP2 over dp (x cp), experts over the ranks holding the same ones
        parallel.shard_experts(model, experts, compute_dtype=compute, reduce_dtype=reduce, reduce_once_a_step=once)
    else:
        parallel.fully_shard_layers(model, replicas, compute_dtype=compute, reduce_dtype=reduce,
                                    reduce_once_a_step=once)
    return model


def fsdp2_precision(spec: RunSpec) -> tuple[torch.dtype | None, torch.dtype | None]:
    """FSDP2's (compute, reduce) dtypes for `spec`: with main parameters, the shards in their
    dtype are gathered in the compute dtype and gradients reduced in the main gradients' dtype
    (Megatron's fp32 main weights and gradients); without, everything in the compute dtype."""
    precision = spec.precision
    if precision.main_params_dtype is None:
        return None, None
    return spec.dtype, DTYPES[precision.main_grads_dtype or precision.main_params_dtype]


def reset_parameters(spec: RunSpec, model: nn.Module) -> None:
    """The weights every run of a spec starts from."""
    stages = model.stage_indices if isinstance(model, Pipeline) else [0]
    for stage, chunk in zip(stages, model_chunks(model)):
        torch.manual_seed(spec.seed + stage)
        spec.family.reset_parameters(chunk)
    if isinstance(model, Pipeline):
        model.tie_weights()  # a tied embedding's copy on the last stage starts as the first's


def apply_plan(spec: RunSpec, model: nn.Module, plan: PlanLike) -> None:
    """Install `plan` (the whole model's) on `model`; on a pipeline, on each of its stages. A
    config's distribute_saved_activations splits what its full-recompute ranges keep over the
    tensor-parallel ranks (and a plan without it takes that off). A config is checked on the
    whole model once and lowered onto each stage's sites: a stage need not have every site it
    names (an MoE model's dense first stage has no `moe`), as on Megatron's stages."""
    if not isinstance(model, Pipeline):
        apply(model, plan)
        distribute_saved_inputs(model, distributes_saved_inputs(plan))
        return
    if isinstance(plan, RecomputeConfig):
        check_config(plan, find_sites(spec.family.build(spec.model_config, device="meta")).layout)
    for stage, chunk in zip(model.stage_indices, model.chunks):
        chunk_plan = stage_plan(plan, spec.pipeline, spec.model_config.num_layers, stage)
        lowered = (Plan.from_config(chunk_plan, find_sites(chunk).layout) if isinstance(chunk_plan, RecomputeConfig)
                   else chunk_plan)
        apply(chunk, lowered)
        distribute_saved_inputs(chunk, distributes_saved_inputs(chunk_plan))


def distributes_saved_inputs(plan: PlanLike) -> bool:
    """Whether `plan` splits full recompute's kept inputs over the tensor-parallel ranks."""
    return isinstance(plan, RecomputeConfig) and plan.distribute_saved_activations


def stage_plan(plan: PlanLike, layout: PipelineLayout, num_layers: int, stage: int) -> PlanLike:
    """What pipeline stage `stage` runs of a whole model's plan: a config as Megatron applies it
    to each (virtual) stage's layers, a per-layer plan cut to the stage's layers."""
    if isinstance(plan, Plan):
        return plan.cut(layout.layers(num_layers, stage))
    if isinstance(plan, RecomputeConfig):
        facts = dataclasses.replace(plan.facts, num_layers=num_layers // layout.chunks, pipeline_model_parallel_size=1,
                                    virtual_pipeline_model_parallel_size=None)
        return dataclasses.replace(plan, facts=facts)
    return plan


def forward_backward(model: nn.Module, data: "MockData", micro_batches: int) -> torch.Tensor:
    """One step's micro-batches, forward and backward, gradients accumulating; the mean loss
    (every pipeline rank gets the last stage's)."""
    if isinstance(model, Pipeline):
        batches = [data.batch() for _ in range(micro_batches)]
        # the schedule runs them interleaved: all sharded at once, for the whole step
        with parallel.sharded(model, batches) as weights:
            return model.forward_backward(batches, weights)
    total = torch.zeros((), device=data.spec.device)
    set_loss_scale(model, 1 / micro_batches)
    for i in range(micro_batches):
        parallel.accumulate(model, last=i == micro_batches - 1)
        input_ids, labels = data.batch()
        with parallel.sharded(model, [(input_ids, labels)]) as (weight,):  # the ring's backward communicates too
            loss = forward_loss(model, input_ids, labels) * weight / micro_batches
            loss.backward()
        total += loss.detach()
    return total


class MockData:
    """Random tokens, a fresh batch per micro-batch, generated on the device (no host copies)."""

    def __init__(self, spec: RunSpec) -> None:
        config = spec.model_config
        self.spec, self.vocab, self.seq = spec, config.vocab_size, config.seq_length
        # each data-parallel replica its own sequences, the same on all of its pipeline stages and
        # context-parallel ranks (each shards them)
        replica = parallel.coordinates(parallel.rank(), spec.stages, spec.data_parallel,
                                       spec.facts.tensor_model_parallel_size, spec.context_parallel).data
        self.generator = torch.Generator(device=spec.device).manual_seed(spec.seed + replica)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, self.vocab, (self.spec.micro_batch_size, self.seq + 1),
                               device=self.spec.device, generator=self.generator)
        labels = tokens[:, 1:].clone()
        if self.spec.task == "sft":
            labels[:, : self.seq // 4] = -100
        return tokens[:, :-1], labels


def make_optimizer(model: nn.Module, spec: RunSpec) -> torch.optim.Optimizer | None:
    """The step's AdamW in the spec's precision, or None for forward+backward runs."""
    if not spec.optimizer:
        return None
    fused = spec.device.startswith("cuda")
    if spec.fully_sharded:  # FSDP2's shards are the main parameters
        return adamw(model.parameters(), fused)
    return make_step_optimizer(model.parameters(), spec.precision, fused=fused)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes on this device: a sharded tensor's local shard."""
    return sum(local.numel() * local.element_size() for local in map(local_tensor, tensors))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """The moments (exp_avg, exp_avg_sq) and any main parameters; the per-parameter step counters
    are scalars, and main gradients are gradients."""
    states = optimizer.state.values() if optimizer is not None else []
    return tensor_bytes(v for s in states for k, v in s.items()
                        if isinstance(v, torch.Tensor) and k not in ("step", "main_grad"))


def release_memory(model: nn.Module) -> None:
    """Drop gradients and cached blocks so the next run starts from the weights alone."""
    for p in model.parameters():
        p.grad = None
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def trace_spec(spec: RunSpec, model: nn.Module | None = None, offload: bool = False,
               min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE,
               progress: Callable[[str], None] | None = None) -> tuple[nn.Module, Trace]:
    """Trace the step a bench of `spec` would run: same model, batch shape, optimizer,
    micro-batches (and, with `offload`, offload actions with that threshold)."""
    if spec.context_parallel > 1:  # the trace's step runs whole sequences through the model
        raise ConfigError([Problem("context_parallel_size", f"is {spec.context_parallel}; the trace steps whole"
                                                            " sequences, not context-parallel shards yet (remat"
                                                            " estimate predicts them by shape); use 1")])
    model = model or build_model(spec)
    reset_parameters(spec, model)
    model.train()
    batch = MockData(spec).batch()
    optimizer = make_optimizer(model, spec)
    measured = trace(model, batch, optimizer=optimizer, micro_batches=spec.micro_batches, offload=offload,
                     min_offloaded_tensor_size=min_offloaded_tensor_size, progress=progress)
    del optimizer, batch
    release_memory(model)
    return model, measured
