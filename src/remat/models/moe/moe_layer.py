"""Megatron Core's MoE layer: top-k router, dropless token permutation, routed experts as grouped
GEMMs (on one rank or split over an expert-parallel group), optional shared experts. Every op is
deterministic, so a recompute replays the same routing and the same sums (a scatter-add's atomics
would not)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from remat.models.family import split_share
from remat.models.llama.model import MLP, silu_mul
from remat.models.moe.config import MoEConfig
from remat.models.moe.dispatch import AllToAll, expert_offsets, permute, unpermute
from remat.sites.site import Site

GroupedMM = Callable[[Tensor, Tensor, Tensor], Tensor]


class _CountTokens(torch.autograd.Function):
    """Identity on the router's probabilities that adds the tokens each expert got to `counts` in
    backward: backward runs once per micro-batch whatever is recomputed, a forward may run twice."""

    @staticmethod
    def forward(ctx, probs: Tensor, tokens_per_expert: Tensor, counts: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(tokens_per_expert)
        ctx.counts = counts
        return probs.view_as(probs)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (tokens_per_expert,) = ctx.saved_tensors
        ctx.counts.add_(tokens_per_expert.to(ctx.counts.dtype))
        return grad, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward scales the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


class _AuxLoss(torch.autograd.Function):
    """Attach an auxiliary loss to an activation (Megatron's MoEAuxLossAutoScaler): the returned
    value is unchanged, and backward adds d(aux_loss) to the graph with grad_output `scale`, the
    factor the step scales the micro-batch's loss by (1 / micro-batches), so that the aux loss
    weighs as much against the main loss whatever the number of micro-batches."""

    @staticmethod
    def forward(ctx, activation: Tensor, aux_loss: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


class TopKRouter(nn.Module):
    """Scores each token against every expert and picks `moe_router_topk` of them: softmax (over
    the top-k, or over all then renormalized with pre_softmax) or sigmoid with DeepSeek-V3's
    group-limited choice and balancing bias; a load-balancing auxiliary loss."""

    expert_bias: Tensor
    local_tokens_per_expert: Tensor

    def __init__(
        self, config: MoEConfig, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size, dtype=dtype, device=device))
        experts = config.num_moe_experts
        # DeepSeek-V3's balancing: a per-expert bias on the choice (not on the weights), moved after
        # each step towards the mean load (update_expert_bias)
        self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32, device=device))
        self.register_buffer(
            "local_tokens_per_expert", torch.zeros(experts, dtype=torch.float32, device=device), persistent=False
        )
        self.loss_scale = 1.0  # the aux loss's gradient scale: the step's scale of its micro-batch loss
        # under context parallelism, the ranks holding the other shares of this rank's sequences
        self.context_group: dist.ProcessGroup | None = None

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=std)
        self.expert_bias.zero_()
        self.local_tokens_per_expert.zero_()

    def forward(self, x: Tensor, sequences: int = 1) -> tuple[Tensor, Tensor, Tensor]:
        """x [tokens, hidden] of `sequences` sequences -> (probs [tokens, k] in float32 or the
        model's wider dtype, experts [tokens, k], tokens_per_expert [experts])."""
        c = self.config
        # scores in float32 at least: bf16 would tie and reorder experts near each other
        logits = F.linear(x, self.weight).to(torch.promote_types(x.dtype, torch.float32))
        softmax_after_topk = c.moe_router_score_function == "softmax" and not c.moe_router_pre_softmax
        scores = torch.sigmoid(logits) if c.moe_router_score_function == "sigmoid" else torch.softmax(logits, -1)
        choice = logits if softmax_after_topk else scores
        if c.moe_router_enable_expert_bias:
            choice = choice + self.expert_bias
        if c.moe_router_num_groups is not None and c.moe_router_group_topk is not None:
            choice = self._limit_to_groups(choice, c.moe_router_num_groups, c.moe_router_group_topk)
        experts = torch.topk(choice, c.moe_router_topk, dim=-1).indices
        if softmax_after_topk:
            probs = torch.softmax(logits.gather(-1, experts), dim=-1)
        else:
            probs = scores.gather(-1, experts)
            if c.moe_router_topk > 1:  # renormalized over the chosen experts
                probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        if c.moe_router_topk_scaling_factor:
            probs = probs * c.moe_router_topk_scaling_factor
        # a scatter-add rather than bincount: its size does not depend on the values (meta estimates)
        chosen = experts.flatten()
        tokens_per_expert = chosen.new_zeros(c.num_moe_experts).scatter_add_(0, chosen, torch.ones_like(chosen))
        if self.training and c.moe_router_enable_expert_bias:
            probs = _CountTokens.apply(probs, tokens_per_expert, self.local_tokens_per_expert)
        if self.training and c.moe_router_load_balancing_type != "none" and c.moe_aux_loss_coeff > 0:
            probs = _AuxLoss.apply(probs, self._aux_loss(scores, experts, sequences), self.loss_scale)
        return probs, experts, tokens_per_expert

    @staticmethod
    def _limit_to_groups(choice: Tensor, groups: int, group_topk: int) -> Tensor:
        """DeepSeek-V3: rank groups by the sum of their two best scores, keep the best
        `group_topk` groups, and choose experts among theirs only."""
        tokens, experts = choice.shape
        grouped = choice.view(tokens, groups, experts // groups)
        group_scores = grouped.topk(min(2, experts // groups), dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, group_scores.topk(group_topk, dim=-1).indices, True
        )
        return grouped.masked_fill(~kept[..., None], float("-inf")).view(tokens, experts)

    def _aux_loss(self, scores: Tensor, experts: Tensor, sequences: int) -> Tensor:
        """Switch-style balancing: coeff * E * sum_i(load fraction_i * mean score_i), over the
        micro-batch or per sequence (seq_aux_loss, DeepSeek-V3) and averaged.

        Under context parallelism a rank holds an equal share of each sequence: the load is the
        mean of the cp group's (Megatron reduces over tp x cp, but under tensor parallelism this
        router sees every token of its tp group already), the scores this rank's own. The
        group's mean of its ranks' losses is then one process's loss, and FSDP2's mean over them
        of their gradients its gradient (each rank's scores get cp x their share)."""
        c = self.config
        if c.moe_router_score_function == "sigmoid":
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        sequences = sequences if c.moe_router_load_balancing_type == "seq_aux_loss" else 1
        routed = torch.zeros_like(scores).scatter_(1, experts, 1.0)
        load = routed.view(sequences, -1, c.num_moe_experts).mean(1) / c.moe_router_topk
        if self.context_group is not None:  # no gradient flows through the load
            dist.all_reduce(load, group=self.context_group)
            load /= dist.get_world_size(self.context_group)
        importance = scores.view(sequences, -1, c.num_moe_experts).mean(1)
        return c.moe_aux_loss_coeff * c.num_moe_experts * (load * importance).sum(-1).mean()

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """After an optimizer step (Megatron does it in finalize_model_grads): move each expert's
        bias towards the mean load by the update rate, and start counting again. The counts are
        this replica's, or the data-parallel group's where the model summed them (MoEModel)."""
        if not self.config.moe_router_enable_expert_bias:
            return
        counts = self.local_tokens_per_expert
        self.expert_bias.add_(self.config.moe_router_bias_update_rate * torch.sign(counts.mean() - counts))
        counts.zero_()


def grouped_mm_loop(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """x [N, in] rows grouped by expert (group g ends at offsets[g]) times weight[g] [in, out]:
    one matmul per expert, for devices and dtypes torch's grouped matmul does not take."""
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
    return torch.cat([chunk @ w for chunk, w in zip(x.split(counts), weight.unbind(0))])


def grouped_mm_torch(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    return torch._grouped_mm(x, weight, offs=offsets)


def grouped_mm_shapes(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """On meta, in a dtype torch's grouped matmul refuses: one matmul with the same output, FLOPs
    and saved tensors (x and the experts' weights), as the per-expert loop cannot split by counts
    a meta tensor does not hold."""
    return x @ weight[0]


def grouped_mm_for(x: Tensor) -> GroupedMM:
    """torch's grouped matmul where it runs forward and backward (CUDA, bf16; and bf16 shapes on
    meta), the per-expert loop elsewhere."""
    if x.device.type == "meta":
        return grouped_mm_torch if hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16 else grouped_mm_shapes
    fast = (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and (torch.cuda.get_device_capability(x.device) >= (9, 0))
    )
    return grouped_mm_torch if fast else grouped_mm_loop


def swiglu_with_probs(fc1: Tensor, probs: Tensor) -> Tensor:
    """The experts' activation with each row scaled by its routing probability (Megatron's
    moe_act region: act(FC1) x probs, the input of FC2)."""
    return (silu_mul(fc1) * probs[:, None]).to(fc1.dtype)


def _expert_seed(layer: int, expert: int, weight: int) -> int:
    """The seed of one expert's weight: torch's seed, the layer and the expert's global index, so
    that a rank holding a share of the experts draws them as one process holding all does."""
    seed = torch.initial_seed()
    for part in (layer, expert, weight):  # a fixed mix, the same in every process and Python
        seed = (seed * 1_000_003 + part) % 2**63
    return seed


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU MLPs with all experts' weights in one tensor each: linear_fc1
    [experts, 2 x ffn, hidden] (gate and up) and linear_fc2 [experts, hidden, ffn]. Under expert
    parallelism it holds a share of them, the first being expert `first_expert`."""

    def __init__(
        self,
        config: MoEConfig,
        *,
        layer: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        experts, ffn = config.local_experts, config.expert_ffn // config.expert_tensor_parallel_size
        self.weight1 = nn.Parameter(torch.empty(experts, 2 * ffn, config.hidden_size, dtype=dtype, device=device))
        self.weight2 = nn.Parameter(torch.empty(experts, config.hidden_size, ffn, dtype=dtype, device=device))
        self.layer, self.first_expert = layer, 0
        # Under expert parallelism a weight gradient sums the tokens of every rank of the group
        # (the all-to-all's backward brings them), where every other gradient sums this rank's
        # own: scaled by 1 / ep, the data-parallel mean over the ranks holding the same experts
        # is the mean over all of them (Megatron's expert gradient scaling).
        self.grad_scale = 1.0
        self.grouped = config.moe_grouped_gemm
        self.fc1_site = Site("expert_fc1")
        self.act_site = Site("moe_act")
        self.activation: Callable[[Tensor, Tensor], Tensor] = swiglu_with_probs

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """Each expert's weights ~ N(0, std) from a generator of its own (see _expert_seed), drawn
        whole and cut where this module holds a tensor-parallel share of them."""
        for index, name in enumerate(("weight1", "weight2")):
            weight = getattr(self, name)
            if weight.is_meta:
                continue
            share, rearrange = split_share(self, name), getattr(self, "whole_to_split", {}).get(name)
            shape = share.whole_shape(weight.shape) if share is not None else weight.shape
            drawn = torch.empty(shape, dtype=weight.dtype, device=weight.device)
            for offset, rows in enumerate(drawn):
                seed = _expert_seed(self.layer, self.first_expert + offset, index)
                rows.normal_(0.0, std, generator=torch.Generator(drawn.device).manual_seed(seed))
            if rearrange is not None:
                rearrange(drawn)
            if share is not None:
                drawn = share.cut(drawn)
            if isinstance(weight, DTensor):  # FSDP2's shard of it
                drawn = distribute_tensor(drawn, weight.device_mesh, weight.placements, src_data_rank=None)
            weight.copy_(drawn)

    def forward(self, x: Tensor, probs: Tensor, offsets: Tensor) -> Tensor:
        """x [N, hidden] grouped by expert, probs [N]; returns [N, hidden]."""
        mm = grouped_mm_for(x) if self.grouped else grouped_mm_loop
        w1, w2 = self.weight1, self.weight2
        if self.grad_scale != 1.0:
            w1, w2 = _ScaleGrad.apply(w1, self.grad_scale), _ScaleGrad.apply(w2, self.grad_scale)
        fc1 = self.fc1_site(mm, x, w1.transpose(1, 2), offsets)
        return mm(self.act_site(self.activation, fc1, probs), w2.transpose(1, 2), offsets)


class MoELayer(nn.Module):
    """router -> permute tokens to their experts (under expert parallelism, over the ranks that
    hold them) -> grouped experts -> back, summing the k outputs, plus the shared experts' MLP on
    every token."""

    def __init__(
        self,
        config: MoEConfig,
        *,
        layer: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.topk, self.local_experts = config.moe_router_topk, config.local_experts
        self.init_std = config.init_method_std
        self.router = TopKRouter(config, dtype=dtype, device=device)
        self.experts = GroupedExperts(config, layer=layer, dtype=dtype, device=device)
        self.dispatch: AllToAll | None = None
        shared = config.moe_shared_expert_intermediate_size
        # no shared experts, no site: a 'shared_experts' label on such a model then names what it has
        self.shared_experts: MLP | None = None
        self.shared_experts_site: Site | None = None
        if shared:
            self.shared_experts = MLP(config, ffn_hidden_size=shared, dtype=dtype, device=device)
            self.shared_experts_site = Site("shared_experts")

    def split_experts(self, group: dist.ProcessGroup) -> None:
        """Hold rank r's share of the experts, [r x local, (r + 1) x local) of `group`'s ranks
        (their weights drawn as one process draws them), and exchange token slots with the others."""
        self.experts.first_expert = dist.get_rank(group) * self.local_experts
        self.experts.grad_scale = 1 / dist.get_world_size(group)
        self.experts.init_weights(self.init_std)
        self.dispatch = AllToAll(group)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        probs, experts, tokens_per_expert = self.router(tokens, sequences=b)
        slots = experts.flatten()
        # Without a dispatch, a config that splits the experts estimates one expert-parallel rank's
        # share by shape: every slot lands on one of its local experts, as a balanced all-to-all would.
        permuted, order, inverse = permute(
            tokens, slots if self.dispatch is not None else slots % self.local_experts, self.topk
        )
        permuted_probs = probs.flatten()[order]
        if self.dispatch is None:
            counts = tokens_per_expert.view(-1, self.local_experts).sum(0)  # global experts onto local ones
            routed = self.experts(permuted, permuted_probs, expert_offsets(counts))
        else:
            routed = self.dispatch(self.experts, permuted, permuted_probs, tokens_per_expert)
        out = unpermute(routed, order, inverse, self.topk).view(b, s, h)
        if self.shared_experts is not None and self.shared_experts_site is not None:
            out = out + self.shared_experts_site(self.shared_experts, x)
        return out
