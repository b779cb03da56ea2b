"""Dense Llama-3 family decoder with Megatron Core's module and config names, and remat Sites.

The model knows nothing of recompute: it only calls its computations through ``Site``s, which
``remat`` may later set to keep, recompute, discard or offload what they save.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from remat.models.kernels import loss, rmsnorm, rope, swiglu
from remat.models.kernels.grad_accumulation import Linear
from remat.models.kernels.loss import LossKernels, chunked_linear_cross_entropy, compiled_loss_kernels
from remat.models.llama.config import LlamaConfig
from remat.sites.site import Site

# F.dropout's signature (input, p, training): what a family may swap for one drawing elsewhere
DropoutFn = Callable[[Tensor, float, bool], Tensor]


def _factory(dtype: torch.dtype | None, device: torch.device | str | None) -> dict:
    return {"dtype": dtype, "device": device}


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm over the hidden size, computed by `kernel`: torch's F.rms_norm (fused where torch
    has a fused kernel), swapped by LlamaModel.compile_regions for remat's Triton one on CUDA."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(size or config.hidden_size, eps=config.norm_epsilon, **_factory(dtype, device))
        self.kernel: rmsnorm.NormFn = rmsnorm.rms_norm

    def forward(self, x: Tensor) -> Tensor:
        return self.kernel(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotate-half RoPE for positions [0, seq_length)."""

    cos: Tensor
    sin: Tensor

    def __init__(
        self, config: LlamaConfig, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.head_dim, self.base = config.rotary_dim, config.rotary_base
        self.seq_length = config.seq_length
        # Non-persistent: rebuilt from the config, never part of a checkpoint.
        empty = torch.empty(self.seq_length, self.head_dim, **_factory(dtype, device))
        self.register_buffer("cos", empty, persistent=False)
        self.register_buffer("sin", empty.clone(), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute the tables (in float32, stored in the buffers' dtype); e.g. after to_empty().
        In place: context parallelism shards these very tensors with each batch."""
        device = self.cos.device
        inv_freq = 1.0 / self.base ** (
            torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        )
        positions = torch.arange(self.seq_length, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, seq_len: int) -> tuple[Tensor, Tensor]:
        if seq_len > self.seq_length:
            raise ValueError(
                f"sequence of {seq_len} tokens exceeds seq_length={self.seq_length}; "
                f"build the model with seq_length >= {seq_len}"
            )
        return self.cos[:seq_len], self.sin[:seq_len]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on x [b, s, n, d] with cos/sin [s, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _expand_kv(x: Tensor, num_heads: int) -> Tensor:
    """[b, groups, s, d] -> [b, heads, s, d]: query head i uses key/value group i // (heads/groups)."""
    return x if x.shape[1] == num_heads else x.repeat_interleave(num_heads // x.shape[1], dim=1)


def split_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """The fused QKV projection's output into heads, with RoPE: qkv [b, s, (heads + 2 * groups) * d]
    -> q [b, s, heads, d], k and v [b, s, groups, d].

    Megatron's fused layout: per query group, its query heads then one key and one value head.
    A pure function of tensors, so one compiled copy serves every layer. Heads stay in the
    sequence-major layout: attention takes them as transposed views, and its gradients, which
    come back in the same strides, then need no copy into the compiled backward. v is copied out
    of the projection's output: as a view it would keep all of q, k and v alive for backward.
    """
    b, s, _ = qkv.shape
    heads_per_group, head_dim = num_heads // num_groups, cos.shape[-1]
    q, k, v = qkv.view(b, s, num_groups, heads_per_group + 2, head_dim).split([heads_per_group, 1, 1], dim=3)
    q = q.reshape(b, s, num_heads, head_dim)
    return apply_rotary(q, cos, sin), apply_rotary(k.squeeze(3), cos, sin), v.squeeze(3).contiguous()


def split_heads(qkv: Tensor, num_heads: int, num_groups: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """split_qkv's layout without RoPE (for norms between the split and RoPE)."""
    b, s, _ = qkv.shape
    q, k, v = qkv.view(b, s, num_groups, num_heads // num_groups + 2, head_dim).split(
        [num_heads // num_groups, 1, 1], dim=3
    )
    return q.reshape(b, s, num_heads, head_dim), k.squeeze(3), v.squeeze(3).contiguous()


def merge_heads(o: Tensor) -> Tensor:
    """[b, heads, s, d] -> [b, s, heads * d]."""
    b, n, s, d = o.shape
    return o.transpose(1, 2).reshape(b, s, n * d)


class SelfAttention(nn.Module):
    """Grouped-query causal self-attention with Megatron's fused ``linear_qkv`` and ``linear_proj``."""

    def __init__(
        self, config: LlamaConfig, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.num_heads, self.num_groups = config.num_attention_heads, config.num_query_groups
        self.head_dim = config.head_dim
        self.backend = config.attention_backend
        self.attention_dropout = config.attention_dropout
        qkv_size = (self.num_heads + 2 * self.num_groups) * self.head_dim
        fuse = config.gradient_accumulation_fusion
        self.linear_qkv = Linear(config.hidden_size, qkv_size, fuse_grads=fuse, **_factory(dtype, device))
        self.linear_proj = Linear(
            config.attention_width, config.hidden_size, fuse_grads=fuse, **_factory(dtype, device)
        )
        # SDPA's fused kernels already recompute the scores in backward; eager keeps them.
        self.core_attn_site = Site("core_attn", fused=self.backend == "sdpa")
        # the scores, softmax, dropout and values (a family may run it drawing from another stream)
        self.attention: Callable[[Tensor, Tensor, Tensor, float, str], Tensor] = causal_attention
        # Qwen3's norms of each query and key head, before RoPE (Megatron's qk_layernorm)
        self.q_layernorm = (
            RMSNorm(config, size=self.head_dim, dtype=dtype, device=device) if config.qk_layernorm else None
        )
        self.k_layernorm = (
            RMSNorm(config, size=self.head_dim, dtype=dtype, device=device) if config.qk_layernorm else None
        )
        # Swapped for compiled versions by LlamaModel.compile_regions (shared by all layers).
        self.split_qkv: rope.SplitFn = split_qkv
        self.merge_heads = merge_heads

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        qkv = self.linear_qkv(x)
        if self.q_layernorm is None or self.k_layernorm is None:
            q, k, v = self.split_qkv(qkv, cos, sin, self.num_heads, self.num_groups)
        else:
            q, k, v = split_heads(qkv, self.num_heads, self.num_groups, self.head_dim)
            q, k = apply_rotary(self.q_layernorm(q), cos, sin), apply_rotary(self.k_layernorm(k), cos, sin)
        o = self.core_attn_site(self.core_attention, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.linear_proj(self.merge_heads(o))

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [b, heads, s, d]; k, v [b, groups, s, d]; returns [b, heads, s, d]."""
        return self.attention(q, k, v, self.attention_dropout if self.training else 0.0, self.backend)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, backend: str) -> Tensor:
    """softmax(causal(QK^T / sqrt(d))) V with dropout: the only place s x s scores exist.

    q [b, heads, s, d]; k [b, groups, s, d]; v [b, groups, s, d_v]; returns [b, heads, s, d_v].
    """
    if backend == "sdpa":
        # enable_gqa keeps k/v unexpanded, which measured faster on cuDNN than expanding them.
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
        )
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    s = q.shape[2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)
    probs = F.softmax(scores, dim=-1, dtype=softmax_dtype).to(q.dtype)
    return F.dropout(probs, dropout_p, dropout_p > 0) @ v


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU's activation on the fused gate/up projection; elementwise, so compiling fuses it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU feed-forward with Megatron's fused gate/up ``linear_fc1`` and ``linear_fc2``."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        ffn_hidden_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        ffn = ffn_hidden_size or config.ffn_hidden_size  # a shared expert's is its own
        self.linear_fc1 = Linear(
            config.hidden_size, 2 * ffn, fuse_grads=config.gradient_accumulation_fusion, **_factory(dtype, device)
        )
        # torch's linear, not the fusing one: it saves its input before its matmul, so a recompute
        # replay of the MLP (or of a whole layer) stops there instead of running the GEMM again.
        self.linear_fc2 = nn.Linear(ffn, config.hidden_size, bias=False, **_factory(dtype, device))
        self.act_site = Site("mlp_act")
        # swapped for a compiled version by LlamaModel.compile_regions
        self.activation: swiglu.ActivationFn = silu_mul

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(self.act_site(self.activation, self.linear_fc1(x)))


class TransformerLayer(nn.Module):
    """Pre-norm decoder layer; its Sites are exactly the places remat acts on."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        self_attention: nn.Module | None = None,
        mlp: nn.Module | None = None,
        mlp_label: str = "mlp",
    ) -> None:
        """`self_attention` and `mlp` replace the dense ones (MLA, an MoE layer, whose Site is
        `mlp_label`); both take the normed hidden states, attention also RoPE's cos and sin."""
        super().__init__()
        self.hidden_dropout = config.hidden_dropout
        self.dropout: DropoutFn = F.dropout  # a family may swap it for one drawing from another stream
        self.input_layernorm = RMSNorm(config, dtype=dtype, device=device)
        self.self_attention = self_attention or SelfAttention(config, dtype=dtype, device=device)
        self.pre_mlp_layernorm = RMSNorm(config, dtype=dtype, device=device)
        self.mlp = mlp or MLP(config, dtype=dtype, device=device)
        self.layer_site = Site("layer")
        self.input_norm_site = Site("layernorm")
        self.pre_mlp_norm_site = Site("layernorm")
        self.mlp_site = Site(mlp_label)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return self.layer_site(self._forward, x, cos, sin)

    def _forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = self.input_norm_site(self.input_layernorm, x)
        x = x + self._dropout(self.self_attention(h, cos, sin))
        h = self.pre_mlp_norm_site(self.pre_mlp_layernorm, x)
        return x + self._dropout(self.mlp_site(self.mlp, h))

    def _dropout(self, x: Tensor) -> Tensor:
        return self.dropout(x, self.hidden_dropout, self.training)


class TransformerBlock(nn.Module):
    """The decoder stack: ``layers`` then ``final_layernorm``."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        final_layernorm: bool = True,
        build_layer: Callable[[int], TransformerLayer] | None = None,
    ) -> None:
        super().__init__()
        build = build_layer or (lambda _: TransformerLayer(config, dtype=dtype, device=device))
        self.layers = nn.ModuleList(build(index) for index in config.layers)
        self.final_layernorm = RMSNorm(config, dtype=dtype, device=device) if final_layernorm else None

    def transformer_layers(self) -> Iterator[TransformerLayer]:
        """The layers, typed (a ModuleList yields them as nn.Module)."""
        for layer in self.layers:
            assert isinstance(layer, TransformerLayer)
            yield layer

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x if self.final_layernorm is None else self.final_layernorm(x)


class LlamaModel(nn.Module):
    """Llama-3 decoder LM whose forward returns the mean next-token loss.

    Parameters are initialized from the global torch seed; on ``device="meta"`` nothing is
    allocated: after ``to_empty(device=...)`` call ``init_weights()`` to fill parameters and the
    RoPE tables, which gives the same values as building on that device directly.

    As in Megatron, a pipeline stage other than the first has no embedding (``pre_process=False``:
    forward takes the previous stage's hidden states) and one other than the last no final norm
    and loss head (``post_process=False``: forward returns hidden states).
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        # Resolves None through any active `with torch.device(...)` context.
        target = torch.empty(0, device=device).device
        # Built on meta, then allocated and filled once by init_weights(): torch's default inits
        # would cost time on big models and consume RNG that a meta-then-to_empty build does not.
        meta = torch.device("meta")
        self.embedding = (
            nn.Embedding(config.vocab_size, config.hidden_size, **_factory(dtype, meta)) if pre_process else None
        )
        self.rotary_pos_emb = RotaryEmbedding(config, dtype=dtype, device=meta)
        self.decoder = TransformerBlock(
            config,
            dtype=dtype,
            device=meta,
            final_layernorm=post_process,
            build_layer=lambda index: self.build_layer(index, dtype, meta),
        )
        self.output_layer = (
            nn.Linear(config.hidden_size, config.vocab_size, bias=False, **_factory(dtype, meta))
            if post_process
            else None
        )
        self.loss_kernels = LossKernels()  # compile_regions compiles them
        self.embedding_dropout: DropoutFn = F.dropout  # a family may swap it for one drawing from another stream
        # Under sequence parallelism a rank holds 1/n of the tokens outside attention and MLP; the
        # rotary tables still cover the whole sequence (Megatron's rotary_seq_len).
        self.sequence_parallel_size = 1
        self.to_empty(device=target)
        self.init_weights()

    def build_layer(self, index: int, dtype: torch.dtype | None, device: torch.device) -> TransformerLayer:
        """Decoder layer `index` of the whole model (a family with other layers, MoE or MLA, builds its own)."""
        return TransformerLayer(self.config, dtype=dtype, device=device)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Linear and embedding weights ~ N(0, init_method_std), norm weights 1, RoPE tables
        rebuilt; modules with weights of their own (experts, routers) fill them by `init_weights(std)`."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.init_method_std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif module is not self and callable(init := getattr(module, "init_weights", None)):
                init(self.config.init_method_std)
        self.rotary_pos_emb.reset_buffers()

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        """Mean cross-entropy over labels != -100; input_ids, labels [b, s], labels already shifted.

        Without pre_process `input_ids` is the previous stage's hidden states [b, s, h]; without
        post_process the result is this stage's hidden states, and labels are unused."""
        x = input_ids
        if self.embedding is not None:
            x = self.embedding_dropout(self.embedding(input_ids), self.config.hidden_dropout, self.training)
        cos, sin = self.rotary_pos_emb(x.shape[1] * self.sequence_parallel_size)
        x = self.decoder(x, cos, sin)
        if self.output_layer is None:
            return x
        return chunked_linear_cross_entropy(
            x.reshape(-1, x.shape[-1]),
            self.output_layer.weight,
            labels.reshape(-1),
            self.config.loss_chunk_size,
            kernels=self.loss_kernels,
            fuse_grads=self.config.gradient_accumulation_fusion,
        )

    def compile_regions(self, backend: str = "inductor") -> None:
        """torch.compile the pure functions around each layer's Sites (the QKV split with RoPE,
        the head merge, the SwiGLU activation) and the loss head's elementwise work; one compiled
        copy of each serves every layer. On CUDA, remat's Triton kernels run instead where they
        measured faster (benchmarks/README.md): the SwiGLU activation with a
        one-pass backward, the QKV split with RoPE in one kernel each way, RMSNorm with a one-pass
        backward, and each loss chunk in one kernel.

        Regions, not the whole model: Sites stay outside compiled code, so every recompute plan
        composes with them (a compiled region's saved tensors go through the Site's hooks).
        `backend` is torch.compile's; on meta tensors remat's estimate uses
        "aot_eager_decomp_partition", which saves what inductor's partitioner saves.
        """
        compiled_qkv, compiled_merge, activation = (
            rope.on_cuda(torch.compile(split_qkv, backend=backend)),
            torch.compile(merge_heads, backend=backend),
            swiglu.on_cuda(torch.compile(silu_mul, backend=backend)),
        )
        for module in self.modules():
            if isinstance(module, SelfAttention):
                module.split_qkv, module.merge_heads = compiled_qkv, compiled_merge
            elif isinstance(module, MLP):
                module.activation = activation
        self.set_norm_kernel(rmsnorm.on_cuda())
        self.loss_kernels = compiled_loss_kernels(backend)

    def use_shape_kernels(self, target: str, compiled: bool) -> None:
        """On the meta device, run pieces that allocate and save what `target`'s kernels would
        (on meta torch takes its unfused paths): with `compiled`, the regions compiled by a
        backend that partitions as inductor does, the loss chunk as inductor's kernel and, for
        CUDA, remat's SwiGLU and QKV Functions (on meta they launch nothing); for CUDA, remat's
        RMSNorm Function, which saves what torch's fused kernel saves."""
        if compiled:  # inductor cannot run on meta tensors
            self.compile_regions(backend="aot_eager_decomp_partition")
            self.loss_kernels = dataclasses.replace(self.loss_kernels, chunk=loss.chunk_loss_shapes)
            if target == "cuda":
                for module in self.modules():
                    if isinstance(module, SelfAttention):
                        module.split_qkv = rope.split_qkv
                    elif isinstance(module, MLP):
                        module.activation = swiglu.activation
        if target == "cuda":
            self.set_norm_kernel(rmsnorm.triton_rms_norm)

    def set_norm_kernel(self, kernel: rmsnorm.NormFn) -> None:
        """Compute every RMSNorm of the model (layers' and final) with `kernel`."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = kernel

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
