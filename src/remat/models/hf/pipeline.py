"""Pipeline stages of Hugging Face decoder-only causal LMs, those laid out as transformers' Llama
is: `model.embed_tokens`, `model.layers`, `model.norm`, `model.rotary_emb` and `lm_head`.

A stage is the transformers model with only its own decoder layers, built whole on the meta
device and cut: the first stage keeps the embedding, the last the final norm and the output layer.
Every stage runs the base model's own forward (the first from token ids, the others from the
previous stage's hidden states as `inputs_embeds`), so position ids, the causal masks and the
rotary tables are computed on each stage as the whole model computes them. The layers keep their
whole-model numbers (`layer_idx`, which fixes a layer's kind: MoE or dense, sliding or full
attention) and their parameter names, so a stage loads the whole model's weights by name.

A tied embedding (`tie_word_embeddings`) is held twice, as Megatron's stages hold it: by the first
stage's embedding and, under its own name `lm_head.weight`, by the last stage's output layer; the
pipeline starts the last copy as the first and sums their gradients (`tied_parameters`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from remat.core.problems import Problem

FIELD = "pipeline_model_parallel_size"
_PARTS = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")


class StageLayers(nn.ModuleList):
    """A stage's decoder layers under their whole-model numbers (`model.layers.5` stays so), in
    order; iterated and sliced as the list of this stage's layers, as the base model's forward does."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    __repr__ = nn.Module.__repr__  # each layer under its own number (ModuleList's counts positions)

    def __getitem__(self, index: Any) -> Any:
        found = list(self._modules.values())[index]
        return nn.ModuleList(found) if isinstance(index, slice) else found


class HfStage(nn.Module):
    """One pipeline stage of a transformers causal LM: its base model (`model`, holding this stage's
    layers) and on the last stage `lm_head`, under the whole model's names. Returns hidden states,
    or on the last stage the causal LM's loss. The causal LM itself (`get_base_model`, as a PEFT
    wrapper has it) is not a child: its modules are this stage's own."""

    lm: Any  # transformers' PreTrainedModel, typed loosely as transformers is

    def __init__(self, lm: Any, layers: Iterable[int], *, pre_process: bool, post_process: bool) -> None:
        super().__init__()
        base: Any = lm.model
        # one weight in the whole model, a copy on each end of the pipeline (one parameter where
        # a stage holds both ends)
        self.tied = lm.lm_head.weight is base.embed_tokens.weight and pre_process != post_process
        base.layers = StageLayers({i: base.layers[i] for i in layers})
        # the base model's forward picks each layer's mask by its position in `layers`
        # (Qwen2's and Gemma's `config.layer_types[i]`): its own config lists this stage's
        if getattr(base.config, "layer_types", None) is not None:
            base.config = copy.copy(base.config)
            base.config.layer_types = [lm.config.layer_types[i] for i in layers]
        if not pre_process:
            base.embed_tokens = None
        if not post_process:
            base.norm = nn.Identity()
            lm.lm_head = None
        self.pre_process, self.post_process = pre_process, post_process
        self.model = base
        self.lm_head = lm.lm_head
        object.__setattr__(self, "lm", lm)

    def get_base_model(self) -> nn.Module:
        lm: nn.Module = self.lm
        return lm

    def tied_parameters(self) -> list[nn.Parameter]:
        """What this stage shares with the stage at the other end of the pipeline: a tied
        embedding's copy (the first stage's embedding weight, the last stage's output layer's)."""
        if not self.tied:
            return []
        return [self.model.embed_tokens.weight if self.pre_process else self.lm_head.weight]

    def train(self, mode: bool = True) -> HfStage:
        self.lm.training = mode  # the causal LM's own flag; its modules are this stage's children
        return super().train(mode)

    def forward(self, x: Tensor, labels: Tensor | None = None, **kwargs: Any) -> Tensor:
        """`x`: token ids on the first stage, else the previous stage's hidden states."""
        inputs = {"input_ids" if self.pre_process else "inputs_embeds": x}
        if not self.post_process:
            hidden: Tensor = self.model(**inputs, **kwargs).last_hidden_state
            return hidden
        loss: Tensor = self.lm(**inputs, labels=labels, **kwargs).loss
        # the pipeline's loss is float32 at least and no narrower than its hidden states; HF's
        # head reduces in float32 (a float64 model's loss is widened, exactly)
        return loss.to(torch.promote_types(loss.dtype, x.dtype)) if x.is_floating_point() else loss


def problems(lm: nn.Module) -> Iterator[Problem]:
    """Why the causal LM `lm` (on meta) cannot be split into pipeline stages."""
    name = type(lm).__name__
    missing = [part for part in _PARTS if not isinstance(_get(lm, part), nn.Module)]
    if missing or not isinstance(_get(lm, "model.layers"), nn.ModuleList):
        yield Problem(
            FIELD,
            f"is above 1; {name} has no {', '.join(missing) or 'model.layers list'}, which remat's"
            " pipeline stages split (Llama's layout); use 1",
        )
        return
    config = lm.config
    if getattr(config, "output_router_logits", False):
        yield Problem(
            "output_router_logits",
            f"is True; {name}'s auxiliary loss reads every layer's router logits,"
            " which other stages hold; set it False under pipeline parallelism",
        )


def _get(module: nn.Module, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part, None)  # type: ignore[assignment]
    return module
