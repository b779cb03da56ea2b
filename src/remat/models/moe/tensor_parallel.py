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

An MoE layer, with Megatron's default expert tensor-parallel size (tp): the router replicated on
every token of the group (gathered first under sequence parallelism), each routed expert's and
the shared experts' FFN split as the dense MLP (this rank's gate and up rows of linear_fc1, its
columns of linear_fc2, as plain local slices: the experts' weights are 3-D, no Linear style
applies), the ranks' partial outputs summed (reduce-scattered to this rank's tokens under sequence
parallelism). The experts' inputs (token slots and their routing probabilities) and the shared
experts' input feed only this rank's share of the FFN, so their gradients are summed over the
ranks before they reach the router and the layer's input: the router's gradient is then whole on
every rank, the auxiliary loss's counted once. Every collective runs inside the layer's call (its
`moe` Site), in the same order on every rank, so a replay runs them again.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
)

from remat.models.family import Fork, Share, record_share
from remat.models.llama.parallel import forked, gate_up_by_rank
from remat.models.moe.mla import MLASelfAttention
from remat.models.moe.moe_layer import MoELayer


def summed_gradient(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """`x`, held whole by every rank; its gradient summed over `mesh` (each rank's is a part)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class SummedGradient(ParallelStyle):
    """A module's first `inputs` inputs unchanged, their gradients summed over the tensor-parallel
    ranks: what every rank holds whole feeds only this rank's share of the module's work. `slices`
    (weight path -> dimension) keeps this rank's slice of the weights of that share, as plain
    parameters."""

    def __init__(self, inputs: int = 1, slices: Mapping[str, int] | None = None) -> None:
        super().__init__()
        self.inputs, self.slices = inputs, dict(slices or {})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        for path, dim in self.slices.items():
            owner, _, name = path.rpartition(".")
            holder = module.get_submodule(owner)
            share = Share(dim, rank, size)
            setattr(holder, name, nn.Parameter(share.cut(getattr(holder, name).detach()).clone()))
            record_share(holder, name, share)  # the weights drawn later are drawn whole, then cut
        n = self.inputs
        module.register_forward_pre_hook(
            lambda _, args: (*(summed_gradient(x, device_mesh) for x in args[:n]), *args[n:])
        )
        return module


def mla_styles(attention: MLASelfAttention, tp: int, tokens: Placement, fork: Fork) -> dict[str, ParallelStyle]:
    """`attention` as one of `tp` ranks (its heads, dropout over them from this rank's stream);
    the styles of its modules by path below it."""
    attention.heads //= tp
    attention.rotary_key.heads //= tp
    attention.attention = forked(fork, attention.attention)
    up = ColwiseParallel(input_layouts=Replicate())
    plan: dict[str, ParallelStyle] = {
        ".linear_kv_up_proj": up,
        ".rotary_key": SummedGradient(),
        ".linear_proj": RowwiseParallel(output_layouts=tokens),
    }
    plan[".linear_q_proj" if attention.linear_q_proj is not None else ".linear_q_up_proj"] = up
    if tokens != Replicate():  # every token into the replicated down projections
        plan[""] = PrepareModuleInput(
            input_layouts=(tokens, None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=True
        )
    return plan


def _each_gate_up_by_rank(weights: Tensor, tp: int) -> None:
    for weight in weights:
        gate_up_by_rank(weight, tp)


def moe_styles(moe: MoELayer, tp: int, tokens: Placement) -> dict[str, ParallelStyle]:
    """`moe` as one of `tp` ranks: its experts' FFN shares, its collectives; the styles of its
    modules by path below it."""
    for weight in moe.experts.weight1:  # each expert's [gate; up] rows
        gate_up_by_rank(weight, tp)
    vars(moe.experts)["whole_to_split"] = {"weight1": functools.partial(_each_gate_up_by_rank, tp=tp)}
    plan: dict[str, ParallelStyle] = {
        "": PrepareModuleInputOutput(
            input_layouts=(tokens,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Partial(),),
            desired_output_layouts=(tokens,),
        ),
        ".experts": SummedGradient(inputs=2, slices={"weight1": 1, "weight2": 2}),
    }
    if moe.shared_experts is not None:
        gate_up_by_rank(moe.shared_experts.linear_fc1.weight, tp)
        vars(moe.shared_experts.linear_fc1)["whole_to_split"] = {"weight": functools.partial(gate_up_by_rank, tp=tp)}
        plan[".shared_experts"] = SummedGradient(slices={"linear_fc1.weight": 0, "linear_fc2.weight": 1})
    return plan
