"""LlamaConfig: the shapes and knobs of a dense Llama-3 model, with Megatron Core's names, and its recipes."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from remat.core.problems import ConfigError, Problem
from remat.models.family import dense_facts

# remat's models compute attention with torch's SDPA (fused kernels) or eagerly (s x s scores kept).
ATTENTION_BACKENDS: tuple[str, ...] = ("sdpa", "eager")
_SIZES = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "seq_length",
    "vocab_size",
    "loss_chunk_size",
)
# The largest value of each size remat builds: far past any published model, small enough that
# even a shapes-only model builds in seconds and no tensor's element count overflows.
MAX_SIZES: dict[str, int] = {
    "num_layers": 1024,
    "hidden_size": 1 << 20,
    "ffn_hidden_size": 1 << 22,
    "num_attention_heads": 1 << 14,
    "num_query_groups": 1 << 14,
    "seq_length": 1 << 24,
    "vocab_size": 1 << 24,
    "loss_chunk_size": 1 << 24,
    "kv_channels": 1 << 16,
}
_LLAMA3_VOCAB = 128256

# Recipe name -> LlamaConfig fields: the true Llama-3 shapes, and a tiny one for tests and CPU runs.
RECIPES: dict[str, dict[str, int]] = {
    "llama3_8b": dict(
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        vocab_size=_LLAMA3_VOCAB,
        seq_length=8192,
    ),
    "llama3_70b": dict(
        num_layers=80,
        hidden_size=8192,
        ffn_hidden_size=28672,
        num_attention_heads=64,
        num_query_groups=8,
        vocab_size=_LLAMA3_VOCAB,
        seq_length=8192,
    ),
    "llama31_405b": dict(
        num_layers=126,
        hidden_size=16384,
        ffn_hidden_size=53248,
        num_attention_heads=128,
        num_query_groups=8,
        vocab_size=_LLAMA3_VOCAB,
        seq_length=8192,
    ),
    "llama3_tiny": dict(
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=160,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=512,
        seq_length=64,
    ),
}


@dataclass
class LlamaConfig:
    """Shapes and knobs of a Llama model, with Megatron Core's argument names."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    seq_length: int
    vocab_size: int
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    attention_backend: str = "sdpa"
    norm_epsilon: float = 1e-5
    rotary_base: float = 500000.0
    init_method_std: float = 0.02
    # Tokens per chunk of the loss head: a chunk's fp32 logits take loss_chunk_size x vocab x 4 B.
    loss_chunk_size: int = 4096
    # Head dim; None: hidden_size / num_attention_heads. A tensor-parallel shard keeps the head
    # dim with fewer heads, so its attention width differs from hidden_size.
    kv_channels: int | None = None
    # Add each linear's weight gradient into .grad inside its GEMM when gradients accumulate
    # (remat.models.kernels.grad_accumulation): Megatron's flag of the same name.
    gradient_accumulation_fusion: bool = True
    # RMSNorm of each query and key head before RoPE (Qwen3)
    qk_layernorm: bool = False
    # The whole model's index of each of this model's layers, where it holds a share of them (a
    # pipeline rank's, set by the family's shard): a layer's kind and seeds follow its index in
    # the whole model. None: layers 0 .. num_layers - 1.
    global_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        problems = shape_problems({name: getattr(self, name) for name in self.field_names()})
        if problems:
            raise ConfigError(problems)

    @property
    def layers(self) -> tuple[int, ...]:
        """The whole model's index of each layer this config builds."""
        return self.global_layers if self.global_layers is not None else tuple(range(self.num_layers))

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Width RoPE rotates: the whole head."""
        return self.head_dim

    @property
    def attention_width(self) -> int:
        """Width of the merged attention heads: linear_proj's input."""
        return self.num_attention_heads * self.head_dim

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def record(self) -> dict[str, Any]:
        """The model's shape as a benchmark result records it."""
        return dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            seq_length=self.seq_length,
            vocab_size=self.vocab_size,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
        )

    def megatron_facts(self) -> dict[str, Any]:
        return dense_facts(self)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _probability(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < 1.0


def _global_layer_problems(layers: Any, num_layers: Any) -> list[Problem]:
    if layers is None:
        return []
    if (
        not isinstance(layers, tuple)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
        or list(layers) != sorted(set(layers))
    ):
        return [Problem("global_layers", f"must be a tuple of ascending layer indices, got {layers!r}")]
    if len(layers) != num_layers:
        return [Problem("global_layers", f"gives {len(layers)} layers but num_layers is {num_layers}")]
    return []


def shape_problems(shape: Mapping[str, Any]) -> list[Problem]:
    """What is wrong with a Llama shape, each problem naming the field to change."""
    problems = [
        Problem(name, f"must be a positive integer, got {shape[name]!r}")
        for name in _SIZES
        if not _positive_int(shape[name])
    ]
    problems += [
        Problem(name, f"is {shape[name]:,}; remat builds at most {limit:,} (far past any published model)")
        for name, limit in MAX_SIZES.items()
        if _positive_int(shape[name]) and shape[name] > limit
    ]
    problems += [
        Problem(name, f"must be positive, got {shape[name]!r}")
        for name in ("norm_epsilon", "rotary_base", "init_method_std")
        if not _positive_number(shape[name])
    ]
    problems += [
        Problem(name, f"must be in [0, 1), got {shape[name]!r}")
        for name in ("attention_dropout", "hidden_dropout")
        if not _probability(shape[name])
    ]
    if shape["attention_backend"] not in ATTENTION_BACKENDS:
        problems.append(
            Problem(
                "attention_backend",
                f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {shape['attention_backend']!r}",
            )
        )
    kv_channels = shape["kv_channels"]
    if kv_channels is not None and not _positive_int(kv_channels):
        problems.append(Problem("kv_channels", f"must be a positive integer or None, got {kv_channels!r}"))
    problems += _global_layer_problems(shape["global_layers"], shape["num_layers"])
    if problems:  # the divisibility rules need valid sizes
        return problems
    return list(
        _head_problems(shape["hidden_size"], shape["num_attention_heads"], shape["num_query_groups"], kv_channels)
    )


def _head_problems(hidden: int, heads: int, groups: int, kv_channels: int | None) -> Iterator[Problem]:
    """The heads of valid sizes: a whole head dim, whole query groups, an even head dim for RoPE."""
    if kv_channels is None and hidden % heads:
        yield Problem(
            "hidden_size",
            f"({hidden}) must be divisible by num_attention_heads ({heads}); change one so"
            " that the head dim is an integer",
        )
    if heads % groups:
        yield Problem(
            "num_query_groups",
            f"num_attention_heads ({heads}) must be divisible by num_query_groups ({groups}); pick a divisor of it",
        )
    head_dim = kv_channels or hidden // heads
    if head_dim % 2:
        yield Problem(
            "kv_channels" if kv_channels else "hidden_size",
            f"head dim {head_dim} must be even for rotary"
            " embeddings; change kv_channels, or"
            " hidden_size or num_attention_heads",
        )
