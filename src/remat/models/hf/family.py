"""Hugging Face transformers causal LMs behind the model seam: recipes `hf:FAMILY` (a small config
of that family, shape overrides in Megatron's names) or `hf:path/to/config.json`. The model is
built from the config (never downloaded) and adapted (`remat.models.adapt`); its fast path is the
chunked loss head where it applies, its Sites' calls compiled and `fusions`."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from remat.config.parallel import ParallelLayout
from remat.core.problems import ConfigError, Problem
from remat.models.family import ModelFamily, Target, dense_facts
from remat.models.hf import catalog, context_parallel, fusions, pipeline, tensor_parallel
from remat.models.hf.adapter import ADAPTER, hf_model, layer_paths
from remat.models.hf.configs import TINY, field_of, hf_config, layer_configs, transformers_module
from remat.models.hf.loss_head import loss_head_problems
from remat.models.hf.parallel import HfParallelism
from remat.sites.placement import compile_sites, place_sites

PREFIX = "hf:"
DEFAULT_SEQ = 64


@dataclasses.dataclass(frozen=True, eq=False)
class HfModelConfig:
    """A transformers config and the sequence length a step runs."""

    source: str  # the family name or config.json it came from
    hf: Any
    seq_length: int
    # the whole model's layers a pipeline stage's model holds, in order; None: every layer
    layers: tuple[int, ...] | None = None

    @property
    def num_layers(self) -> int:
        # the layers the model holds: num_hidden_layers counts LongCat's half-layers, HRM's passes
        return _meta_counts(self.hf.to_json_string(), self).layers if self.layers is None else len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.hf.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.hf.vocab_size)

    @property
    def ffn_hidden_size(self) -> int:
        return int(
            getattr(self.hf, "intermediate_size", None) or getattr(self.hf, "n_inner", None) or 4 * self.hidden_size
        )

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf.num_attention_heads)

    @property
    def num_query_groups(self) -> int:
        return int(getattr(self.hf, "num_key_value_heads", None) or self.num_attention_heads)

    @property
    def attention_dropout(self) -> float:
        return float(getattr(self.hf, "attention_dropout", getattr(self.hf, "attn_pdrop", 0.0)) or 0.0)

    @property
    def hidden_dropout(self) -> float:
        return float(getattr(self.hf, "hidden_dropout", getattr(self.hf, "resid_pdrop", 0.0)) or 0.0)

    def megatron_facts(self) -> dict[str, Any]:
        """Dense facts, and for MoE and MLA models what their labels need: transformers' experts
        run as grouped GEMMs (moe_act's rule), DeepSeek's attention is multi-latent."""
        facts = dense_facts(self)
        if field_of(self.hf, "num_moe_experts"):
            facts["moe_grouped_gemm"] = True
        if getattr(self.hf, "kv_lora_rank", None):
            facts["multi_latent_attention"] = True
        return facts

    def record(self) -> dict[str, Any]:
        return {
            "hf_config": self.source,
            "model_type": self.hf.model_type,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "seq_length": self.seq_length,
            "vocab_size": self.vocab_size,
        }


def _build(config: HfModelConfig, dtype: torch.dtype | None, device: torch.device | str | None) -> Any:
    transformers = transformers_module()
    kwargs: dict[str, Any] = {}
    model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config.hf)]
    if field_of(config.hf, "num_moe_experts") and model_class._can_set_experts_implementation():
        # torch's grouped GEMM takes bf16 (on meta, and float64 nowhere); other dtypes run the
        # experts as batched matmuls, whose shapes, unlike the eager loop's, do not depend on routing
        kwargs["experts_implementation"] = "grouped_mm" if dtype == torch.bfloat16 else "batched_mm"
    with torch.device(device or "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config.hf, dtype=dtype, **kwargs)
    model.config.use_cache = False
    return model


def _attention_width(hf: Any) -> int:
    """heads x (query-key + value head dims) of one layer's attention: what its two matmuls
    (QK^T and PV) multiply per pair of tokens; 0 for a layer without attention (state-space)."""
    heads = getattr(hf, "num_attention_heads", None) or 0
    qk = getattr(hf, "qk_head_dim", None) or getattr(hf, "head_dim", None) or hf.hidden_size // max(heads, 1)
    return heads * (qk + (getattr(hf, "v_head_dim", None) or qk))


def _matmul_params(config: HfModelConfig) -> tuple[int, int]:
    """(parameters every token multiplies by, those of its routed experts), on a meta model."""
    counts = _meta_counts(config.hf.to_json_string(), config)
    return counts.dense, counts.routed


class MetaCounts(NamedTuple):
    dense: int  # matmul parameters every token multiplies by
    routed: int  # those of the routed experts
    layers: int  # decoder layers, as adapt finds them (num_hidden_layers where it finds none)


@functools.lru_cache(maxsize=16)
def _meta_counts(key: str, config: HfModelConfig) -> MetaCounts:
    model = _build(config, None, "meta")
    dense = routed = 0
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.Conv1d, nn.Conv2d)):
            continue
        for p in module.parameters(recurse=False):
            # transformers stacks routed experts' weights, [experts, out, in]; a Linear's are 2-D
            if p.dim() == 3:
                routed += p.numel()
            elif p.dim() == 2:
                dense += p.numel()
    if getattr(model.config, "tie_word_embeddings", False):  # the output layer is the embedding's weight
        dense += model.get_output_embeddings().weight.numel()
    return MetaCounts(dense, routed, len(layer_paths(model)) or config.hf.num_hidden_layers)


@functools.lru_cache(maxsize=16)
def _pipeline_problems(key: str, config: HfModelConfig) -> tuple[Problem, ...]:
    return tuple(pipeline.problems(_build(config, None, "meta")))


def _packed_sequences_on_meta() -> None:
    """transformers looks for packed sequences by reading position_ids' values, which a meta tensor
    has none of: on meta there are none (a mock batch packs none), elsewhere it looks as before."""
    masking = transformers_module().masking_utils
    found = masking.find_packed_sequence_indices
    if getattr(found, "remat_meta", False):
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> Any:
        return None if position_ids.is_meta else found(position_ids)

    find_packed_sequence_indices.remat_meta = True  # type: ignore[attr-defined]
    masking.find_packed_sequence_indices = find_packed_sequence_indices


# A family's small config that still holds more parameters than this is refused: its sizes live in
# sub-configs that the tiny fields do not reach (BLT's patcher, encoder and decoder).
SMALL_PARAMETERS = 50_000_000


def _small_problems(config: HfModelConfig) -> None:
    """ConfigError if `config`, a family's small one, is not small (counted on the meta device)."""
    if not hasattr(config.hf, "num_hidden_layers"):
        raise ConfigError(
            [
                Problem(
                    "hf_config",
                    f"{config.hf.model_type}'s config has no num_hidden_layers (its layers are set in"
                    " sub-configs), which remat reads; adapt the model in Python with a site map",
                )
            ]
        )
    dense, routed = _matmul_params(config)
    if dense + routed > SMALL_PARAMETERS:
        raise ConfigError(
            [
                Problem(
                    "hf_config",
                    f"the small {config.hf.model_type} config still has {(dense + routed) / 1e6:.0f} M matmul"
                    " parameters (sizes in sub-configs remat does not shrink); give a config.json",
                )
            ]
        )


def _of(config: HfModelConfig | Any) -> HfModelConfig | None:
    """`config`, or what context_parallel_model passes, a built model's `config`: a transformers
    config, as one of unknown sequence length (0: its splits pass; a batch is checked when it is
    sharded), or None for a pipeline stage, whose causal LM `context_parallel.prepare` checks when
    `HfParallelism.context_buffers` runs."""
    if config is None or isinstance(config, HfModelConfig):
        return config
    return HfModelConfig(config.model_type, config, 0)


class HfFamily(ModelFamily):
    name = "hf"
    kind = "Hugging Face models"
    runs = frozenset({"tp", "pp", "cp"})

    def recipes(self) -> Mapping[str, Mapping[str, Any]]:
        if importlib.util.find_spec("transformers") is None:  # listed where they can be built
            return {}
        return {f"{PREFIX}{family}": {"model_type": model_type} for family, model_type in TINY.items()}

    def owns(self, recipe: str) -> bool:
        return recipe.startswith(PREFIX)

    def config(self, recipe: str, **overrides: Any) -> HfModelConfig:
        source = recipe.removeprefix(PREFIX)
        seq = overrides.pop("seq_length", None) or DEFAULT_SEQ
        hf = hf_config(source, **overrides)
        if getattr(hf, "max_position_embeddings", seq) < seq:
            hf.max_position_embeddings = seq
        config = HfModelConfig(source, hf, seq)
        if source in catalog.causal_lm_types() or source in TINY:
            _small_problems(config)
        return config

    def build(
        self,
        config: HfModelConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> nn.Module:
        if pre_process and post_process and config.layers is None:
            return place_sites(_build(config, dtype, device), None, ADAPTER)
        # the whole model on meta, cut to the stage's share, then allocated and initialized
        lm = _build(config, dtype, "meta")
        problems = list(pipeline.problems(lm))
        if problems:
            raise ConfigError(problems)
        layers = range(config.num_layers) if config.layers is None else config.layers
        stage = pipeline.HfStage(lm, layers, pre_process=pre_process, post_process=post_process)
        target = torch.empty(0, device=device).device
        if target.type != "meta":
            stage.to_empty(device=target)
            self.reset_parameters(stage)
        return place_sites(stage, None, ADAPTER)

    def reset_parameters(self, model: nn.Module) -> None:
        init: Any = hf_model(model)._init_weights
        model.apply(init)

    def handles(self, model: nn.Module) -> bool:
        return ADAPTER.handles(model)

    def layout_problems(self, config: HfModelConfig, layout: ParallelLayout) -> Iterator[Problem]:
        # tensor parallelism by the model's own plan, pipeline stages cut from the model
        yield from super().layout_problems(config, layout)
        if (known := _of(config)) is None:
            return
        config = known
        yield from tensor_parallel.config_problems(config.hf, layout.tp)
        if layout.sequence_split > 1 and config.seq_length % layout.tp:
            yield Problem(
                "sequence_parallel",
                f"seq_length={config.seq_length} does not split over {layout.tp}"
                " tensor-parallel ranks; use a multiple of the tensor-parallel size,"
                " or drop --sequence_parallel",
            )
        if layout.pp > 1:
            yield from _pipeline_problems(config.hf.to_json_string(), config)
        if layout.sequence_split > 1 and layout.pp > 1:
            yield Problem(
                "sequence_parallel",
                "Hugging Face stages hand each other whole hidden states (the next"
                " stage takes positions from them); drop --sequence_parallel beside"
                " -pp",
            )
        if layout.cp > 1:
            yield from context_parallel.problems(config.hf, config.seq_length, layout)

    def shard(self, config: HfModelConfig, layout: ParallelLayout, layers: Sequence[int]) -> HfModelConfig:
        layers = tuple(layers)
        every = layers == tuple(range(config.num_layers))  # the whole model, built as one
        return dataclasses.replace(
            config,
            hf=tensor_parallel.shard_config(config.hf, layout.tp),
            layers=None if every else layers,
            seq_length=config.seq_length // layout.cp,
        )

    def parallelism(self, model: nn.Module, layout: ParallelLayout) -> HfParallelism:
        return HfParallelism(model, layout, self.name)

    def flops(self, config: HfModelConfig, tokens_per_seq: int, sequences: int) -> float:
        """6 x (matmul parameters, routed experts at top-k of all) x tokens, plus attention's two
        matmuls (QK^T and PV at their head dims, the causal mask not halved)."""
        hf = config.hf
        dense, routed = _matmul_params(config)
        experts = field_of(hf, "num_moe_experts")
        active = dense + (routed * field_of(hf, "moe_router_topk") / experts if experts else routed)
        widths = sum(map(_attention_width, layer_configs(hf)))
        attention = 6 * sequences * tokens_per_seq**2 * widths
        return float(6 * active * sequences * tokens_per_seq + attention)

    def use_kernels(self, model: nn.Module, target: Target, *, compiled: bool, shapes_only: bool = False) -> None:
        if shapes_only:
            _packed_sequences_on_meta()
        if not compiled:
            return
        # the chunked loss head where it stands in for the model's (a stage before the last has none)
        last = not isinstance(model, pipeline.HfStage) or model.post_process
        place_sites(model, None, ADAPTER, loss_head=last and not list(loss_head_problems(hf_model(model))))
        if not shapes_only:
            compile_sites(model)
            fusions.compile_rotary(model)
            fusions.compile_routers(model)
            fusions.use_grouped_experts(model)


FAMILY = HfFamily()
