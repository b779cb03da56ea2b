"""The MoE family's layers under tensor parallelism, as Megatron splits them, in torch's styles.

Multi-latent attention: the down projections and their norms are replicated (plain weights every
rank holds whole, run on every token: under sequence parallelism the attention's input is
gathered first), the up projections split by columns (this rank's heads), linear_proj by rows.
Every gradient reaching the replicated part is the whole one, identical on every rank: the
column-parallel up projections sum their input's gradient over the ranks (torch's ColwiseParallel
on a replicated input), and so does the shared rotary key, which feeds only this rank's heads
(`SummedGradient`, Megatron's copy_to_tensor_model_parallel_region). So the replicated weights'
gradients need no reduction, and under sequence parallelism the gathered input's gradient is
split back to this rank's tokens, not reduce-scattered (torch's PrepareModuleInput does that: the
gradient of a Replicate input is Replicate).
"""
from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from remat.models.family import Fork
from remat.models.llama.family import forked
from remat.models.moe.mla import MLASelfAttention


def summed_gradient(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """`x`, held whole by every rank; its gradient summed over `mesh` (each rank's is a part)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class SummedGradient(ParallelStyle):
    """A module's first input unchanged, its gradient summed over the tensor-parallel ranks: the
    input every rank holds whole feeds only this rank's share of the module's work."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(lambda _, args: (summed_gradient(args[0], device_mesh), *args[1:]))
        return module


def mla_plan(attention: MLASelfAttention, tp: int, tokens: Placement, fork: Fork) -> dict[str, ParallelStyle]:
    """`attention` as one of `tp` ranks (its heads, dropout over them from this rank's stream);
    the styles of its modules by path below it."""
    attention.heads //= tp
    attention.rotary_key.heads //= tp
    attention.attention = forked(fork, attention.attention)
    up = ColwiseParallel(input_layouts=Replicate())
    plan: dict[str, ParallelStyle] = {".linear_kv_up_proj": up, ".rotary_key": SummedGradient(),
                                      ".linear_proj": RowwiseParallel(output_layouts=tokens)}
    plan[".linear_q_proj" if attention.linear_q_proj is not None else ".linear_q_up_proj"] = up
    if tokens != Replicate():  # every token into the replicated down projections
        plan[""] = PrepareModuleInput(input_layouts=(tokens, None, None), desired_input_layouts=(Replicate(), None, None),
                                      use_local_output=True)
    return plan
