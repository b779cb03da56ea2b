"""One training step, as every measurement in remat runs it: mock data, micro-batches of forward
and backward (gradients accumulating), the optimizer; and the trace of the step a bench would run."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable

import torch
from torch import nn

from remat import parallel
from remat.config.fields import MIN_OFFLOADED_TENSOR_SIZE
from remat.core.problems import ConfigError, Problem
from remat.memory.measure import trace
from remat.memory.meter import local_tensor
from remat.memory.prediction import Trace
from remat.parallel import Pipeline
from remat.parallel.seeding import named_seed
from remat.run.build import build_model, reset_parameters
from remat.run.optimizer import adamw
from remat.run.optimizer import make as make_step_optimizer
from remat.run.spec import RunSpec
from remat.sites.calls import forward_loss, set_loss_scale


def forward_backward(model: nn.Module, data: MockData, micro_batches: int) -> torch.Tensor:
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
    """Random tokens, a fresh batch per micro-batch, generated on the device (no host copies). The
    same global batch under every layout: sequence k of the run (each step's global batch is the
    next `micro_batches x micro_batch_size x dp` of them) is drawn from a generator seeded by the
    spec's seed and k; a data-parallel rank takes its consecutive share of each step's, the same on
    all of its pipeline stages and its context- and tensor-parallel ranks (they shard them)."""

    def __init__(self, spec: RunSpec) -> None:
        config = spec.model_config
        self.spec, self.vocab, self.seq = spec, config.vocab_size, config.seq_length
        self.replica = spec.layout.coordinates(parallel.rank()).dp
        self.calls = 0  # micro-batches handed out

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.stack([self._sequence(k) for k in self._sequences()])
        labels = tokens[:, 1:].clone()
        if self.spec.task == "sft":
            labels[:, : self.seq // 4] = -100
        return tokens[:, :-1], labels

    def _sequences(self) -> range:
        """The run's indices of the sequences of this rank's next micro-batch."""
        spec, micro_batches = self.spec, self.spec.micro_batches
        step, index = divmod(self.calls, micro_batches)
        self.calls += 1
        size = spec.micro_batch_size
        first = (step * spec.layout.dp + self.replica) * micro_batches * size + index * size
        return range(first, first + size)

    def _sequence(self, k: int) -> torch.Tensor:
        generator = torch.Generator(device=self.spec.device).manual_seed(named_seed(self.spec.seed, f"sequence {k}"))
        return torch.randint(0, self.vocab, (self.seq + 1,), device=self.spec.device, generator=generator)


def make_optimizer(model: nn.Module, spec: RunSpec) -> torch.optim.Optimizer | None:
    """The step's AdamW in the spec's precision, or None for forward+backward runs."""
    if not spec.optimizer:
        return None
    fused = spec.device.startswith("cuda")
    if spec.fully_sharded:  # FSDP2's shards are the main parameters
        return adamw(model.parameters(), fused)
    return make_step_optimizer(model.parameters(), spec.optimizer_precision, fused=fused)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes on this device: a sharded tensor's local shard."""
    return sum(local.numel() * local.element_size() for local in map(local_tensor, tensors))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """The moments (exp_avg, exp_avg_sq) and any main parameters; the per-parameter step counters
    are scalars, and main gradients are gradients."""
    states = optimizer.state.values() if optimizer is not None else []
    return tensor_bytes(
        v for s in states for k, v in s.items() if isinstance(v, torch.Tensor) and k not in ("step", "main_grad")
    )


def release_memory(model: nn.Module) -> None:
    """Drop gradients and cached blocks so the next run starts from the weights alone."""
    for p in model.parameters():
        p.grad = None
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def trace_spec(
    spec: RunSpec,
    model: nn.Module | None = None,
    offload: bool = False,
    min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE,
    progress: Callable[[str], None] | None = None,
) -> tuple[nn.Module, Trace]:
    """Trace the step a bench of `spec` would run: same model, batch shape, optimizer,
    micro-batches (and, with `offload`, offload actions with that threshold)."""
    if spec.layout.cp > 1:  # the trace's step runs whole sequences through the model
        raise ConfigError(
            [
                Problem(
                    "context_parallel_size",
                    f"is {spec.layout.cp}; the trace steps whole"
                    " sequences, not context-parallel shards yet (remat"
                    " estimate predicts them by shape); use 1",
                )
            ]
        )
    model = model or build_model(spec)
    reset_parameters(spec, model)
    model.train()
    batch = MockData(spec).batch()
    optimizer = make_optimizer(model, spec)
    measured = trace(
        model,
        batch,
        optimizer=optimizer,
        micro_batches=spec.micro_batches,
        offload=offload,
        min_offloaded_tensor_size=min_offloaded_tensor_size,
        progress=progress,
    )
    del optimizer, batch
    release_memory(model)
    return model, measured
