"""MoEConfig: a decoder with mixture-of-experts layers and, optionally, multi-latent attention
(DeepSeek-V3, Qwen3-MoE, Mixtral), with Megatron Core's names, and its recipes."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from remat.core.problems import ConfigError, Problem
from remat.models.family import dense_facts
from remat.models.llama.config import LlamaConfig, shape_problems

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")

_DEEPSEEK_V3: dict[str, Any] = dict(
    num_layers=61,
    hidden_size=7168,
    ffn_hidden_size=18432,
    num_attention_heads=128,
    num_query_groups=128,
    vocab_size=129280,
    seq_length=4096,
    rotary_base=10000.0,
    norm_epsilon=1e-6,
    num_moe_experts=256,
    moe_router_topk=8,
    moe_ffn_hidden_size=2048,
    moe_shared_expert_intermediate_size=2048,
    moe_layer_freq="[0]*3+[1]*58",
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_num_groups=8,
    moe_router_group_topk=4,
    moe_router_topk_scaling_factor=2.5,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-4,
    multi_latent_attention=True,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
)
_QWEN3_MOE: dict[str, Any] = dict(
    num_query_groups=4,
    kv_channels=128,
    vocab_size=151936,
    seq_length=4096,
    rotary_base=1000000.0,
    norm_epsilon=1e-6,
    qk_layernorm=True,
    num_moe_experts=128,
    moe_router_topk=8,
    moe_router_pre_softmax=True,
    moe_aux_loss_coeff=1e-3,
)

# Recipe name -> MoEConfig fields: the published shapes (Megatron Bridge's recipes), and tiny ones
# for tests and CPU runs. A slice that fits one GPU overrides num_layers, num_moe_experts and
# moe_layer_freq.
RECIPES: dict[str, dict[str, Any]] = {
    "deepseek_v3": _DEEPSEEK_V3,
    "qwen3_30b_a3b": dict(
        _QWEN3_MOE,
        num_layers=48,
        hidden_size=2048,
        ffn_hidden_size=6144,
        num_attention_heads=32,
        moe_ffn_hidden_size=768,
    ),
    "qwen3_235b_a22b": dict(
        _QWEN3_MOE,
        num_layers=94,
        hidden_size=4096,
        ffn_hidden_size=12288,
        num_attention_heads=64,
        moe_ffn_hidden_size=1536,
    ),
    "mixtral_8x7b": dict(
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        vocab_size=32000,
        seq_length=4096,
        rotary_base=1000000.0,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=14336,
        moe_aux_loss_coeff=1e-2,
    ),
    "moe_tiny": dict(
        num_layers=3,
        hidden_size=64,
        ffn_hidden_size=160,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=512,
        seq_length=64,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_shared_expert_intermediate_size=64,
        moe_layer_freq="[0]*1+[1]*2",
        moe_aux_loss_coeff=1e-2,
        qk_layernorm=True,
    ),
    "deepseek_tiny": dict(
        _DEEPSEEK_V3,
        num_layers=3,
        hidden_size=64,
        ffn_hidden_size=160,
        num_attention_heads=4,
        num_query_groups=4,
        vocab_size=512,
        seq_length=64,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=32,
        moe_layer_freq="[0]*1+[1]*2",
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=12,
    ),
}

_FREQ_TERM = re.compile(r"\[([01])\]\*(\d+)")


def layer_pattern(freq: int | str | list[int], num_layers: int) -> list[int] | str:
    """Megatron's moe_layer_freq as one 0 (dense) or 1 (MoE) per layer, or why it is not one:
    an int N puts MoE in every N-th layer (0, N, 2N, ...); a list, or Megatron's string form
    "[0]*3+[1]*58", gives each layer."""
    if isinstance(freq, bool):
        return f"must be an int, a list of 0/1 or a string like '[0]*3+[1]*58', got {freq!r}"
    if isinstance(freq, int):
        if freq < 1:
            return f"must be at least 1 (every N-th layer is MoE), got {freq}"
        return [int(i % freq == 0) for i in range(num_layers)]
    if isinstance(freq, str):
        terms = freq.replace(" ", "").split("+")
        matches = [_FREQ_TERM.fullmatch(term) for term in terms]
        if not all(matches):
            return f"{freq!r} is not of the form '[0]*3+[1]*58'"
        freq = [int(m.group(1)) for m in matches if m for _ in range(int(m.group(2)))]
    if not isinstance(freq, list) or any(v not in (0, 1) or isinstance(v, bool) for v in freq):
        return f"must be an int, a list of 0/1 or a string like '[0]*3+[1]*58', got {freq!r}"
    if len(freq) != num_layers:
        return (
            f"gives {len(freq)} layers but num_layers is {num_layers}; give one 0 (dense) or 1 (MoE) per "
            f"layer, e.g. '[0]*1+[1]*{num_layers - 1}'"
        )
    return freq


@dataclass
class MoEConfig(LlamaConfig):
    """A Llama-style decoder whose MLPs are mixtures of experts, with Megatron Core's names."""

    num_moe_experts: int = 8
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0  # 0: ffn_hidden_size
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | str | list[int] = 1
    moe_router_score_function: str = "softmax"
    # softmax over all experts before top-k (Qwen3-MoE, then renormalized) rather than over the top-k
    moe_router_pre_softmax: bool = False
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    # routed experts as grouped GEMMs (torch's grouped matmul where it runs, else a loop)
    moe_grouped_gemm: bool = True
    # one rank's share under a parallel layout (set by the family's shard, never an override): an
    # expert-parallel rank holds num_moe_experts / expert_model_parallel_size experts
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    _pattern: list[int] = field(default_factory=list, init=False, repr=False, compare=False)
    _moe_layers: set[int] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        problems = shape_problems({name: getattr(self, name) for name in LlamaConfig.field_names()})
        problems += moe_problems(self)
        if problems:
            raise ConfigError(problems)
        pattern = layer_pattern(self.moe_layer_freq, self.num_layers)
        assert isinstance(pattern, list)
        self._pattern = pattern
        self._moe_layers = {index for index, moe in zip(self.layers, pattern) if moe}

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(name for name in super().field_names() if not name.startswith("_"))

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def local_experts(self) -> int:
        return self.num_moe_experts // self.expert_model_parallel_size

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` of the whole model (one of this config's `layers`) is MoE."""
        return index in self._moe_layers

    @property
    def head_dim(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim if self.multi_latent_attention else super().head_dim

    @property
    def rotary_dim(self) -> int:
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else super().rotary_dim

    @property
    def attention_width(self) -> int:
        return self.num_attention_heads * (self.v_head_dim if self.multi_latent_attention else self.head_dim)

    def record(self) -> dict[str, Any]:
        # the whole model's shape: a result records ep beside the other parallel sizes, from the layout
        return dict(
            super().record(),
            num_moe_experts=self.num_moe_experts,
            moe_router_topk=self.moe_router_topk,
            moe_ffn_hidden_size=self.expert_ffn,
            moe_layer_freq=self._pattern,
            multi_latent_attention=self.multi_latent_attention,
        )

    def megatron_facts(self) -> dict[str, Any]:
        return dict(
            dense_facts(self),
            moe_grouped_gemm=self.moe_grouped_gemm,
            multi_latent_attention=self.multi_latent_attention,
            moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
        )


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# the MoE and MLA fields that are positive integers, and those that may also be None
_SIZES = (
    "num_moe_experts",
    "moe_router_topk",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
)
_OPTIONAL_SIZES = (
    "moe_shared_expert_intermediate_size",
    "q_lora_rank",
    "moe_router_num_groups",
    "moe_router_group_topk",
)


def moe_problems(c: MoEConfig) -> list[Problem]:
    """What is wrong with the MoE and MLA fields, each naming the field to change."""
    problems = list(_field_problems(c))
    if isinstance(pattern := layer_pattern(c.moe_layer_freq, c.num_layers if _positive(c.num_layers) else 0), str):
        problems.append(Problem("moe_layer_freq", pattern))
    if any(p.field != "moe_layer_freq" for p in problems):  # the rules below need valid sizes
        return problems
    return problems + list(_routing_problems(c))


def _field_problems(c: MoEConfig) -> Iterator[Problem]:
    """Each field of the wrong kind or out of its range."""
    for name in _SIZES:
        if not _positive(getattr(c, name)):
            yield Problem(name, f"must be a positive integer, got {getattr(c, name)!r}")
    for name in _OPTIONAL_SIZES:
        if (value := getattr(c, name)) is not None and not _positive(value):
            yield Problem(name, f"must be a positive integer or None, got {value!r}")
    if not (isinstance(c.moe_ffn_hidden_size, int) and c.moe_ffn_hidden_size >= 0):
        yield Problem(
            "moe_ffn_hidden_size", f"must be a whole number (0: ffn_hidden_size), got {c.moe_ffn_hidden_size!r}"
        )
    if c.moe_router_score_function not in SCORE_FUNCTIONS:
        yield Problem(
            "moe_router_score_function",
            f"must be one of {', '.join(SCORE_FUNCTIONS)}, got {c.moe_router_score_function!r}",
        )
    if c.moe_router_load_balancing_type not in LOAD_BALANCING:
        yield Problem(
            "moe_router_load_balancing_type",
            f"must be one of {', '.join(LOAD_BALANCING)}, got {c.moe_router_load_balancing_type!r}",
        )


def _routing_problems(c: MoEConfig) -> Iterator[Problem]:
    """The routing the valid sizes ask for: top-k of the experts, group-limited routing that can hold
    it, the expert bias of a sigmoid router, MLA's rotary part of an even width."""
    experts, topk = c.num_moe_experts, c.moe_router_topk
    if topk > experts:
        yield Problem(
            "moe_router_topk",
            f"({topk}) exceeds num_moe_experts ({experts}); route to at most as many experts as there are",
        )
    groups, group_topk = c.moe_router_num_groups, c.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        yield Problem(
            "moe_router_group_topk",
            "group-limited routing needs both moe_router_num_groups and moe_router_group_topk; set both or neither",
        )
    elif groups is not None and group_topk is not None:
        if experts % groups:
            yield Problem("moe_router_num_groups", f"({groups}) must divide num_moe_experts ({experts})")
        elif group_topk > groups or topk > group_topk * (experts // groups):
            yield Problem(
                "moe_router_group_topk",
                f"({group_topk}) groups of {experts // groups} experts cannot hold moe_router_topk={topk} choices",
            )
    if c.moe_router_enable_expert_bias and c.moe_router_score_function != "sigmoid":
        yield Problem(
            "moe_router_enable_expert_bias",
            "the expert bias (DeepSeek-V3's balancing) needs moe_router_score_function='sigmoid'",
        )
    if c.multi_latent_attention and c.qk_pos_emb_head_dim % 2:
        yield Problem("qk_pos_emb_head_dim", f"({c.qk_pos_emb_head_dim}) must be even for rotary embeddings")


def config_fields(recipe: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A recipe's fields with overrides; a num_layers override keeps the recipe's dense layers
    first (DeepSeek's first 3) where moe_layer_freq is not given too."""
    fields_ = {**recipe, **overrides}
    if (
        "num_layers" in overrides
        and "moe_layer_freq" not in overrides
        and isinstance(recipe.get("moe_layer_freq"), str)
    ):
        pattern = layer_pattern(recipe["moe_layer_freq"], recipe["num_layers"])
        if isinstance(pattern, list):
            dense = min(pattern.index(1) if 1 in pattern else len(pattern), max(overrides["num_layers"] - 1, 0))
            fields_["moe_layer_freq"] = f"[0]*{dense}+[1]*{overrides['num_layers'] - dense}"
    return fields_
