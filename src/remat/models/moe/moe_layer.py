"""Megatron Core's MoE layer: top-k router, dropless token permutation, routed experts as grouped
GEMMs, optional shared experts. Every op is deterministic, so a recompute replays the same routing
and the same sums (a scatter-add's atomics would not)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from remat.models.llama.model import MLP, silu_mul
from remat.models.moe.config import MoEConfig
from remat.sites import Site

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


class _AuxLoss(torch.autograd.Function):
    """Attach an auxiliary loss to an activation (Megatron's MoEAuxLossAutoScaler): the returned
    value is unchanged, and backward adds d(aux_loss) to the graph with grad_output 1."""

    @staticmethod
    def forward(ctx, activation: Tensor, aux_loss: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux_loss)
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss)


class TopKRouter(nn.Module):
    """Scores each token against every expert and picks `moe_router_topk` of them: softmax (over
    the top-k, or over all then renormalized with pre_softmax) or sigmoid with DeepSeek-V3's
    group-limited choice and balancing bias; a load-balancing auxiliary loss."""

    expert_bias: Tensor
    local_tokens_per_expert: Tensor

    def __init__(self, config: MoEConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size, dtype=dtype, device=device))
        experts = config.num_moe_experts
        # DeepSeek-V3's balancing: a per-expert bias on the choice (not on the weights), moved after
        # each step towards the mean load (update_expert_bias)
        self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32, device=device))
        self.register_buffer("local_tokens_per_expert", torch.zeros(experts, dtype=torch.float32, device=device),
                             persistent=False)

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
            probs = _AuxLoss.apply(probs, self._aux_loss(scores, experts, sequences))
        return probs, experts, tokens_per_expert

    @staticmethod
    def _limit_to_groups(choice: Tensor, groups: int, group_topk: int) -> Tensor:
        """DeepSeek-V3: rank groups by the sum of their two best scores, keep the best
        `group_topk` groups, and choose experts among theirs only."""
        tokens, experts = choice.shape
        grouped = choice.view(tokens, groups, experts // groups)
        group_scores = grouped.topk(min(2, experts // groups), dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, group_scores.topk(group_topk, dim=-1).indices, True)
        return grouped.masked_fill(~kept[..., None], float("-inf")).view(tokens, experts)

    def _aux_loss(self, scores: Tensor, experts: Tensor, sequences: int) -> Tensor:
        """Switch-style balancing: coeff * E * sum_i(load fraction_i * mean score_i), over the
        micro-batch or per sequence (seq_aux_loss, DeepSeek-V3) and averaged."""
        c = self.config
        if c.moe_router_score_function == "sigmoid":
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        sequences = sequences if c.moe_router_load_balancing_type == "seq_aux_loss" else 1
        routed = torch.zeros_like(scores).scatter_(1, experts, 1.0)
        load = routed.view(sequences, -1, c.num_moe_experts).mean(1) / c.moe_router_topk
        importance = scores.view(sequences, -1, c.num_moe_experts).mean(1)
        return c.moe_aux_loss_coeff * c.num_moe_experts * (load * importance).sum(-1).mean()

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """After an optimizer step (Megatron does it in finalize_model_grads): move each expert's
        bias towards the mean load by the update rate, and start counting again."""
        if not self.config.moe_router_enable_expert_bias:
            return
        counts = self.local_tokens_per_expert
        self.expert_bias.add_(self.config.moe_router_bias_update_rate * torch.sign(counts.mean() - counts))
        counts.zero_()


class _Permute(torch.autograd.Function):
    """Rows of x in expert order: row j of the result is token order[j] // k. Backward sums each
    token's k gradient rows in a fixed order (index_put's atomics would not be reproducible)."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, inverse: Tensor, topk: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        ctx.topk = topk
        return x[order // topk]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return grad[inverse].view(-1, ctx.topk, grad.shape[-1]).sum(1), None, None, None


class _Unpermute(torch.autograd.Function):
    """Back to token order, summing each token's k expert outputs in a fixed order."""

    @staticmethod
    def forward(ctx, y: Tensor, order: Tensor, inverse: Tensor, topk: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(order)
        ctx.topk = topk
        return y[inverse].view(-1, topk, y.shape[-1]).sum(1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        (order,) = ctx.saved_tensors
        return grad[order // ctx.topk], None, None, None


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
    fast = hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16 and (
        torch.cuda.get_device_capability(x.device) >= (9, 0))
    return grouped_mm_torch if fast else grouped_mm_loop


def swiglu_with_probs(fc1: Tensor, probs: Tensor) -> Tensor:
    """The experts' activation with each row scaled by its routing probability (Megatron's
    moe_act region: act(FC1) x probs, the input of FC2)."""
    return (silu_mul(fc1) * probs[:, None]).to(fc1.dtype)


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU MLPs with all experts' weights in one tensor each: linear_fc1
    [experts, 2 x ffn, hidden] (gate and up) and linear_fc2 [experts, hidden, ffn]."""

    def __init__(self, config: MoEConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        experts, ffn = config.local_experts, config.expert_ffn // config.expert_tensor_parallel_size
        self.weight1 = nn.Parameter(torch.empty(experts, 2 * ffn, config.hidden_size, dtype=dtype, device=device))
        self.weight2 = nn.Parameter(torch.empty(experts, config.hidden_size, ffn, dtype=dtype, device=device))
        self.grouped = config.moe_grouped_gemm
        self.fc1_site = Site("expert_fc1")
        self.act_site = Site("moe_act")
        self.activation: Callable[[Tensor, Tensor], Tensor] = swiglu_with_probs

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.weight1, mean=0.0, std=std)
        nn.init.normal_(self.weight2, mean=0.0, std=std)

    def forward(self, x: Tensor, probs: Tensor, offsets: Tensor) -> Tensor:
        """x [N, hidden] grouped by expert, probs [N]; returns [N, hidden]."""
        mm = grouped_mm_for(x) if self.grouped else grouped_mm_loop
        fc1 = self.fc1_site(mm, x, self.weight1.transpose(1, 2), offsets)
        return mm(self.act_site(self.activation, fc1, probs), self.weight2.transpose(1, 2), offsets)


class MoELayer(nn.Module):
    """router -> permute tokens to their experts -> grouped experts -> unpermute and sum the k
    outputs, plus the shared experts' MLP on every token."""

    def __init__(self, config: MoEConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.topk, self.local_experts = config.moe_router_topk, config.local_experts
        self.router = TopKRouter(config, dtype=dtype, device=device)
        self.experts = GroupedExperts(config, dtype=dtype, device=device)
        shared = config.moe_shared_expert_intermediate_size
        # no shared experts, no site: a 'shared_experts' label on such a model then names what it has
        self.shared_experts: MLP | None = None
        self.shared_experts_site: Site | None = None
        if shared:
            self.shared_experts = MLP(config, ffn_hidden_size=shared, dtype=dtype, device=device)
            self.shared_experts_site = Site("shared_experts")

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        probs, experts, tokens_per_expert = self.router(tokens, sequences=b)
        # An expert-parallel rank's share (estimated by shape): every token slot lands on one of
        # its local experts, as a balanced all-to-all would deliver them.
        local = experts.flatten() % self.local_experts
        order = torch.argsort(local, stable=True)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        counts = tokens_per_expert.view(-1, self.local_experts).sum(0)  # global experts onto local ones
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        routed = self.experts(_Permute.apply(tokens, order, inverse, self.topk), probs.flatten()[order], offsets)
        out = _Unpermute.apply(routed, order, inverse, self.topk).view(b, s, h)
        if self.shared_experts is not None and self.shared_experts_site is not None:
            out = out + self.shared_experts_site(self.shared_experts, x)
        return out


