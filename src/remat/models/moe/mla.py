"""Multi-latent attention in the DeepSeek-V3 form, with Megatron Core's module names."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from remat.models.kernels.grad_accumulation import Linear
from remat.models.llama.model import RMSNorm, apply_rotary, causal_attention, merge_heads
from remat.models.moe.config import MoEConfig
from remat.sites.site import Site


class RotaryKey(nn.Module):
    """The rotated part of every head's key: one head [b, s, rope], rotated and shared by `heads`
    heads. A module, so that a tensor-parallel style sees its input (which feeds only this rank's
    heads under tensor parallelism)."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, k_rope: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """-> [b, heads, s, rope], a view expanded over the heads."""
        b, s, rope = k_rope.shape
        return apply_rotary(k_rope.view(b, s, 1, rope), cos, sin).expand(b, s, self.heads, rope).transpose(1, 2)


class MLASelfAttention(nn.Module):
    """Queries and keys/values compressed to low ranks, normed, then projected up per head. Each
    head's query and key are a part without position (qk_head_dim) and a rotated part
    (qk_pos_emb_head_dim; the key's is one head shared by all). `mla_up_proj` marks the up
    projections with RoPE: their outputs are what core attention saves, so they can be discarded
    and rebuilt for its backward."""

    def __init__(
        self, config: MoEConfig, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        c = config
        self.heads, self.qk_dim, self.rope_dim, self.v_dim = (
            c.num_attention_heads,
            c.qk_head_dim,
            c.qk_pos_emb_head_dim,
            c.v_head_dim,
        )
        self.kv_lora_rank = c.kv_lora_rank
        q_width = self.heads * (self.qk_dim + self.rope_dim)

        def linear(in_features: int, out_features: int) -> Linear:
            return Linear(
                in_features, out_features, fuse_grads=c.gradient_accumulation_fusion, dtype=dtype, device=device
            )

        if c.q_lora_rank is None:
            self.linear_q_proj: Linear | None = linear(c.hidden_size, q_width)
        else:
            self.linear_q_proj = None
            self.linear_q_down_proj = linear(c.hidden_size, c.q_lora_rank)
            self.q_layernorm = RMSNorm(c, size=c.q_lora_rank, dtype=dtype, device=device)
            self.linear_q_up_proj = linear(c.q_lora_rank, q_width)
        self.linear_kv_down_proj = linear(c.hidden_size, c.kv_lora_rank + self.rope_dim)
        self.kv_layernorm = RMSNorm(c, size=c.kv_lora_rank, dtype=dtype, device=device)
        self.linear_kv_up_proj = linear(c.kv_lora_rank, self.heads * (self.qk_dim + self.v_dim))
        self.rotary_key = RotaryKey(self.heads)
        self.linear_proj = linear(self.heads * self.v_dim, c.hidden_size)
        self.backend, self.attention_dropout = c.attention_backend, c.attention_dropout
        self.up_proj_site = Site("mla_up_proj")
        self.core_attn_site = Site("core_attn", fused=self.backend == "sdpa")
        # the scores, softmax, dropout and values (a family may run it drawing from another stream)
        self.attention: Callable[[Tensor, Tensor, Tensor, float, str], Tensor] = causal_attention

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q_latent = x if self.linear_q_proj is not None else self.q_layernorm(self.linear_q_down_proj(x))
        kv_latent, k_rope = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q, k, v = self.up_proj_site(self.up_project, q_latent, self.kv_layernorm(kv_latent), k_rope, cos, sin)
        o = self.core_attn_site(self.core_attention, q, k, v)
        return self.linear_proj(merge_heads(o))

    def up_project(
        self, q_latent: Tensor, kv_latent: Tensor, k_rope: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """-> q, k [b, heads, s, qk + rope] and v [b, heads, s, v] (a view of the kv projection)."""
        b, s, _ = kv_latent.shape
        q_proj = self.linear_q_proj if self.linear_q_proj is not None else self.linear_q_up_proj
        q_nope, q_rope = q_proj(q_latent).view(b, s, self.heads, -1).split([self.qk_dim, self.rope_dim], dim=-1)
        k_nope, v = (
            self.linear_kv_up_proj(kv_latent).view(b, s, self.heads, -1).split([self.qk_dim, self.v_dim], dim=-1)
        )
        # built head-major, as attention takes them: what it saves is then these very tensors
        q = torch.cat((q_nope.transpose(1, 2), apply_rotary(q_rope, cos, sin).transpose(1, 2)), dim=-1)
        k = torch.cat((k_nope.transpose(1, 2), self.rotary_key(k_rope, cos, sin)), dim=-1)
        return q, k, v.transpose(1, 2).contiguous()

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.attention(q, k, v, self.attention_dropout if self.training else 0.0, self.backend)
