"""Context parallelism by torch's `context_parallel`: each rank of a context-parallel group holds
two chunks of every sequence (chunk i and 2cp-1-i, torch's head-tail load balancing for causal
attention), and torch runs `scaled_dot_product_attention` as ring attention over the group.

torch shards a batch, its labels and the model's position tables (RoPE) in place inside its
context, and the model is told where its tokens sit in the whole sequence (a Hugging Face model
counts them from the tokens it is given); labels that the model's loss shifts itself are shifted
over the whole sequence before. The context must enclose both forward and backward: the ring's
backward communicates, and a recompute replay of attention (a `core_attn` or full-layer Region)
runs the ring's forward again from backward, on every rank in the same order since every rank
runs the same graph. Beside pipeline parallelism one context encloses a schedule's whole step,
whose micro-batches run interleaved: all of them and every chunk's tables sharded at once, and
each stage sends its shard of the hidden states to the same cp rank of the next (a pipeline group
has one cp coordinate).

torch dispatches the ring to its CUDA kernels only (flash and memory-efficient attention, and
cuDNN's where the torch version's ring has it). On CPU, remat hands torch's own ring
(`_templated_ring_attention` and its backward) the CPU flash kernel, so the same ring, load
balancing and merge run on gloo; the backends are pinned to those the ring handles, so an
unhandled one fails instead of running SDPA's math on a sequence shard. That kernel takes one head
dimension for queries, keys and values, so MLA's narrower values are padded for it.

Beside tensor parallelism attention holds this rank's heads as plain tensors, so the ring runs
over them unchanged. Hidden dropout draws as Megatron's, whose seeds have no cp term: the default
generators alike on every cp rank, and under sequence parallelism a tp rank's own stream alike on
its cp peers (each over its own tokens).

Each rank's loss is its tokens' mean; weighted by its share of the group's labelled tokens, the
mean over the group is the sequence's mean, and FSDP2's mean over dp x cp is its gradient. An MoE
router's auxiliary loss takes the group's load alike (its `ModelParallelism.context_buffers`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel

from remat.core.problems import ConfigError, Problem, raise_if_any
from remat.parallel.pipeline import model_chunks
from remat.parallel.state import (
    ContextShards,
    ParallelState,
    built_layout_problems,
    mesh_problems,
    planned,
    state_of,
    unknown_model_problems,
)

try:  # torch >= 2.10 moved the ring into a package
    from torch.distributed.tensor.experimental._context_parallel import _attention as _ring
except ImportError:
    from torch.distributed.tensor.experimental import _attention as _ring  # type: ignore[no-redef]

aten = torch.ops.aten
IGNORE_INDEX = -100  # labels the loss skips (the SFT prompt)
SEQ_DIM = 2  # of attention's [batch, heads, sequence, head_dim]


@contextlib.contextmanager
def _sharded(chunks: Sequence[ParallelState], batches: Sequence[tuple[Tensor, Tensor]]) -> Iterator[list[Tensor]]:
    """Shard each micro-batch's `input_ids` and `labels` [b, s] in place to this rank's tokens,
    with the position tables of every chunk, for the forwards and backwards inside (a pipeline's
    schedule runs them interleaved); the chunks told their tokens' positions. Yields the weight of
    each micro-batch's loss on this rank."""
    shards = [state.context for state in chunks if state.context is not None]
    mesh = shards[0].mesh
    buffers = [b for shard in shards for b in shard.buffers]
    tensors = [t for batch in batches for t in batch]
    lengths = {*(t.shape[1] for t in tensors), *(b.shape[dim] for b, dim in buffers)}
    if len(lengths) > 1:  # one load-balancing permutation serves them all
        raise ValueError(
            f"the batch, its labels and the model's position tables have {sorted(lengths)}"
            " positions; context parallelism needs a batch of the model's seq_length"
        )
    if chunks[0].parallelism.shifts_labels:  # a chunk's last token is labelled by the next chunk's first
        for _, labels in batches:
            labels.copy_(F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX))
    positions = torch.arange(lengths.pop(), device=tensors[0].device)[None]
    sharded = [*tensors, positions]
    dims = [1] * len(sharded) + [dim for _, dim in buffers]
    with (
        context_parallel(
            mesh, buffers=[*sharded, *(b for b, _ in buffers)], buffer_seq_dims=dims, no_restore_buffers=set(sharded)
        ),
        _kernels(mesh.device_type),
    ):
        for state in chunks:
            state.parallelism.set_positions(positions)
        try:
            yield [_loss_weight(mesh, labels) for _, labels in batches]
        finally:
            for state in chunks:
                state.parallelism.set_positions(None)


def _loss_weight(mesh: DeviceMesh, labels: Tensor) -> Tensor:
    """cp x this rank's labelled tokens / the group's: 1 where every rank holds as many."""
    mine = (labels != IGNORE_INDEX).sum().to(torch.float32)
    total = mine.clone()
    dist.all_reduce(total, group=mesh.get_group())
    return mine * mesh.size() / total.clamp(min=1)


def context_parallel_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Run `model` over the ranks of `mesh` (one dimension) by context parallelism: each batch
    `sharded` shards its sequences and the model's position tables. Call on every rank of the
    group, after `parallelize_tensor` where that splits it too (torch's ring then runs over each
    rank's own heads) and before FSDP2 (which then reduces gradients over dp x cp). Raises one
    ConfigError with every problem before changing anything. Returns `model`."""
    raise_if_any([*mesh_problems(mesh, "context-parallel", "cp"), *unknown_model_problems(model)])
    # beside sequence parallelism each rank's seq / cp tokens split again over its tp ranks
    state = planned(model, cp=mesh.size())
    raise_if_any(built_layout_problems(model, state))
    return shard_context(state, mesh)


def shard_context(state: ParallelState, mesh: DeviceMesh) -> nn.Module:
    """`context_parallel_model` on a model whose layout's problems are checked."""
    state.context = ContextShards(mesh, state.parallelism.context_buffers(mesh.get_group()))
    return state.parallelism.model


def sharded(
    model: nn.Module, batches: Sequence[tuple[Tensor, Tensor]]
) -> contextlib.AbstractContextManager[Sequence[Tensor | float]]:
    """Around micro-batches' forward and backward (one, or a pipeline's step of them): under
    context parallelism, each (input_ids, labels) sharded to this rank's tokens with the position
    tables of the model, or of every chunk of a `Pipeline` (see _sharded);
    otherwise as they are. Yields the weight of each one's loss (1 without context parallelism)."""
    found = [
        state for chunk in model_chunks(model) if (state := state_of(chunk)) is not None and state.context is not None
    ]
    if not found:
        return contextlib.nullcontext([1.0] * len(batches))
    return _sharded(found, batches)


@contextlib.contextmanager
def _kernels(device_type: str) -> Iterator[None]:
    """SDPA pinned to the kernels torch's ring handles on `device_type`; on CPU, its flash kernel
    handed to torch's ring."""
    if device_type != "cpu":
        cudnn = [SDPBackend.CUDNN_ATTENTION] if hasattr(_ring, "_scaled_dot_product_ring_cudnn_attention") else []
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, *cudnn]):
            yield
        return
    dispatcher = DTensor._op_dispatcher
    handlers = dispatcher._custom_op_handlers  # torch's context swapped in its own: put back on exit
    ring_sdpa = F.scaled_dot_product_attention  # torch's context patched it: likewise
    dispatcher._custom_op_handlers = {**handlers, **_CPU_HANDLERS}
    F.scaled_dot_product_attention = _values_padded(ring_sdpa)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            yield
    finally:
        dispatcher._custom_op_handlers = handlers
        F.scaled_dot_product_attention = ring_sdpa


def _values_padded(sdpa: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """`sdpa` taking values with fewer channels than the queries (MLA's): the CPU flash kernel
    takes one head dimension for all three, so the values are padded with zeros, whose outputs
    (zeros, and their gradients) are cut off again."""

    @functools.wraps(sdpa)
    def run(query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        width = value.shape[-1]
        if width >= query.shape[-1]:
            return sdpa(query, key, value, *args, **kwargs)
        return sdpa(query, key, F.pad(value, (0, query.shape[-1] - width)), *args, **kwargs)[..., :width]

    return run


def _ring_group(mesh: DeviceMesh, fn: Any) -> Any:
    """What torch's ring function `fn` takes first: the mesh (torch 2.6) or its process group."""
    return mesh if next(iter(inspect.signature(fn).parameters)) == "mesh" else mesh.get_group()


def _shards(mesh: DeviceMesh, *tensors: Tensor) -> tuple[DTensor, ...]:
    return tuple(DTensor.from_local(t, mesh, [Shard(SEQ_DIM)], run_check=False) for t in tensors)


def _cpu_flash(
    query: DTensor,
    key: DTensor,
    value: DTensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
) -> tuple[DTensor, ...]:
    """aten._scaled_dot_product_flash_attention_for_cpu's signature, run by torch's ring."""
    if attn_mask is not None or dropout_p:
        # the family's layout_problems refuse both before a run; a model called otherwise lands here
        raise ConfigError(
            [
                Problem(
                    "context_parallel_size",
                    "torch's ring attention runs here without an attention mask or dropout; drop them or use -cp 1",
                )
            ]
        )
    mesh = query.device_mesh
    ring = _ring._templated_ring_attention
    out, lse = ring(
        _ring_group(mesh, ring),
        SEQ_DIM,
        aten._scaled_dot_product_flash_attention_for_cpu,
        query.to_local(),
        key.to_local(),
        value.to_local(),
        is_causal=is_causal,
        dropout_p=0.0,
        scale=scale,
    )
    return _shards(mesh, out, lse)


def _cpu_flash_backward(
    grad_out: DTensor,
    query: DTensor,
    key: DTensor,
    value: DTensor,
    out: DTensor,
    logsumexp: DTensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
) -> tuple[DTensor, ...]:
    """aten._scaled_dot_product_flash_attention_for_cpu_backward's signature, run by torch's ring."""
    mesh = query.device_mesh
    ring = _ring._templated_ring_attention_backward
    grads = ring(
        _ring_group(mesh, ring),
        SEQ_DIM,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out.to_local(),
        grad_out_name="grad_out",
        query=query.to_local(),
        key=key.to_local(),
        value=value.to_local(),
        out=out.to_local(),
        logsumexp=logsumexp.to_local(),
        is_causal=is_causal,
        dropout_p=dropout_p,
        attn_mask=attn_mask,
        scale=scale,
    )
    return _shards(mesh, *grads)


# DTensor's handlers of the CPU flash ops: (op, args, kwargs) -> outputs
_CPU_HANDLERS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: lambda _op, args, kwargs: _cpu_flash(*args, **kwargs),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: lambda _op, args, kwargs: _cpu_flash_backward(
        *args, **kwargs
    ),
}
