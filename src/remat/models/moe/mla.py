"""Multi-latent attention in the DeepSeek-V3 form, with Megatron Core's module names."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from remat.models.kernels.grad_accumulation import linear
from remat.models.llama.model import RMSNorm, apply_rotary, causal_attention, merge_heads
from remat.models.moe.config import MoEConfig
from remat.sites import Site


def _linear(in_features: int, out_features: int, dtype: torch.dtype | None,
            device: torch.device | str | None) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False, dtype=dtype, device=device)


class MLASelfAttention(nn.Module):
    """Queries and keys/values compressed to low ranks, normed, then projected up per head. Each
    head's query and key are a part without position (qk_head_dim) and a rotated part
    (qk_pos_emb_head_dim; the key's is one head shared by all). `mla_up_proj` marks the up
    projections with RoPE: their outputs are what core attention saves, so they can be discarded
    and rebuilt for its backward."""

    def __init__(self, config: MoEConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        c = config
        self.heads, self.qk_dim, self.rope_dim, self.v_dim = (c.num_attention_heads, c.qk_head_dim,
                                                              c.qk_pos_emb_head_dim, c.v_head_dim)
        self.kv_lora_rank = c.kv_lora_rank
        q_width = self.heads * (self.qk_dim + self.rope_dim)
        if c.q_lora_rank is None:
            self.linear_q_proj: nn.Linear | None = _linear(c.hidden_size, q_width, dtype, device)
        else:
            self.linear_q_proj = None
            self.linear_q_down_proj = _linear(c.hidden_size, c.q_lora_rank, dtype, device)
            self.q_layernorm = RMSNorm(c, size=c.q_lora_rank, dtype=dtype, device=device)
            self.linear_q_up_proj = _linear(c.q_lora_rank, q_width, dtype, device)
        self.linear_kv_down_proj = _linear(c.hidden_size, c.kv_lora_rank + self.rope_dim, dtype, device)
        self.kv_layernorm = RMSNorm(c, size=c.kv_lora_rank, dtype=dtype, device=device)
        self.linear_kv_up_proj = _linear(c.kv_lora_rank, self.heads * (self.qk_dim + self.v_dim), dtype, device)
        self.linear_proj = _linear(self.heads * self.v_dim, c.hidden_size, dtype, device)
        self.backend, self.attention_dropout = c.attention_backend, c.attention_dropout
        self.fuse_grads = c.gradient_accumulation_fusion
        self.up_proj_site = Site("mla_up_proj")
        self.core_attn_site = Site("core_attn", fused=self.backend == "sdpa")

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.linear_q_proj is not None:
            q_latent = x
        else:
            q_latent = self.q_layernorm(linear(x, self.linear_q_down_proj.weight, self.fuse_grads))
        kv_latent, k_rope = linear(x, self.linear_kv_down_proj.weight, self.fuse_grads).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1)
        q, k, v = self.up_proj_site(self.up_project, q_latent, self.kv_layernorm(kv_latent), k_rope, cos, sin)
        o = self.core_attn_site(self.core_attention, q, k, v)
        return linear(merge_heads(o), self.linear_proj.weight, self.fuse_grads)

    def up_project(self, q_latent: Tensor, kv_latent: Tensor, k_rope: Tensor, cos: Tensor,
                   sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """-> q, k [b, heads, s, qk + rope] and v [b, heads, s, v] (a view of the kv projection)."""
        b, s, _ = kv_latent.shape
        q_weight = self.linear_q_proj.weight if self.linear_q_proj is not None else self.linear_q_up_proj.weight
        q_nope, q_rope = linear(q_latent, q_weight, self.fuse_grads).view(b, s, self.heads, -1).split(
            [self.qk_dim, self.rope_dim], dim=-1)
        k_nope, v = linear(kv_latent, self.linear_kv_up_proj.weight, self.fuse_grads).view(
            b, s, self.heads, -1).split([self.qk_dim, self.v_dim], dim=-1)
        k_rope = apply_rotary(k_rope.view(b, s, 1, self.rope_dim), cos, sin).expand(b, s, self.heads, self.rope_dim)
        # built head-major, as attention takes them: what it saves is then these very tensors
        q = torch.cat((q_nope.transpose(1, 2), apply_rotary(q_rope, cos, sin).transpose(1, 2)), dim=-1)
        k = torch.cat((k_nope.transpose(1, 2), k_rope.transpose(1, 2)), dim=-1)
        return q, k, v.transpose(1, 2).contiguous()

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return causal_attention(q, k, v, self.attention_dropout if self.training else 0.0, self.backend)
