"""Hugging Face causal LMs under context parallelism (remat.parallel.context_parallel: torch's ring
attention in place of SDPA, each rank holding a head and a tail chunk of every sequence).

transformers counts a model's positions from the tokens it is given (0 .. n-1), so a rank's
chunks would rotate as the sequence's first tokens. Handing it position ids with the chunks' jump
makes its masking find packed sequences and build a mask, and torch's ring runs causal attention
only without one (is_causal). So the model goes on counting (no mask: SDPA is causal) and its
rotary embedding alone takes where the rank's tokens sit in the whole sequence.

HF's loss shifts its labels by one within what it is given, which on a rank's tokens would pair
its head chunk's last token with its tail chunk's first label; context parallelism shifts them over
the whole sequence before sharding (`shifts_labels`), and the model takes them as HF's
`shift_labels`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from remat.config.parallel import ParallelLayout
from remat.core.problems import ConfigError, Problem
from remat.models.hf.adapter import hf_model

# The attribute of a prepared base model (the one whose rotary embedding reads the positions) that
# holds its tokens' positions while a sharded batch runs.
POSITIONS = "_remat_context_positions"


@dataclass
class _Positions:
    tokens: Tensor | None = None


def problems(hf: Any, seq_length: int, layout: ParallelLayout) -> Iterator[Problem]:
    """Why a model of transformers config `hf` cannot run over `layout.cp` ranks; seq_length 0:
    unknown (a built model's; the batch is checked when sharded)."""
    cp, tp = layout.cp, layout.tp
    if seq_length % (2 * cp):
        yield Problem(
            "context_parallel_size",
            f"seq_length={seq_length} does not split into {2 * cp} chunks for"
            f" {cp} context-parallel ranks; use a multiple of {2 * cp}",
        )
    elif layout.sequence_split > 1 and (seq_length // cp) % tp:
        yield Problem(
            "sequence_parallel",
            f"each rank's {seq_length // cp} tokens do not split over {tp}"
            f" tensor-parallel ranks; use a sequence length that is a multiple of"
            f" {tp * cp}, or drop --sequence_parallel",
        )
    name = type(hf).__name__
    if getattr(hf, "rope_parameters", None) is None:
        yield Problem(
            "context_parallel_size",
            f"{name} has no rotary embedding (GPT-2's positions are a learned table of the tokens it is given); use 1",
        )
    if getattr(hf, "_attn_implementation", None) not in (None, "sdpa"):
        yield Problem(
            "attn_implementation",
            f"is {hf._attn_implementation!r}; torch's context parallelism runs"
            " scaled_dot_product_attention as ring attention; use sdpa",
        )
    if float(getattr(hf, "attention_dropout", 0.0) or 0.0):
        yield Problem(
            "attention_dropout",
            f"is {hf.attention_dropout}; torch's ring attention draws it per block"
            " of keys, and its backward replays one block's random state for all"
            " of them; use 0 under context parallelism",
        )
    if _sliding(hf):
        yield Problem(
            "context_parallel_size",
            f"{name} has sliding-window layers, whose mask torch's ring attention does not take; use 1",
        )
    if getattr(hf, "attn_logit_softcapping", None):
        yield Problem("context_parallel_size", f"{name} soft-caps its attention scores, which SDPA does not; use 1")
    if getattr(hf, "output_router_logits", False):
        yield Problem(
            "output_router_logits",
            "the router's load-balancing loss would count this rank's tokens"
            " only; turn it off under context parallelism",
        )


def _sliding(hf: Any) -> bool:
    """Whether some layer attends within a sliding window (Mistral's, Gemma's; Qwen2's when on)."""
    if any(kind != "full_attention" for kind in getattr(hf, "layer_types", None) or ()):
        return True
    return bool(getattr(hf, "sliding_window", None)) and getattr(hf, "use_sliding_window", True) is not False


def prepare(model: nn.Module, layout: ParallelLayout) -> None:
    """Have `model`'s rotary embedding take the positions `set_positions` gives, and its loss the
    labels as shifted already, while a sharded batch runs; ConfigError if its causal LM's config
    (a pipeline stage's too) cannot run over `layout.cp` ranks."""
    lm: Any = hf_model(model)
    base: Any = lm.base_model
    found = list(problems(lm.config, 0, layout))
    if not isinstance(getattr(base, "rotary_emb", None), nn.Module):
        found.append(
            Problem(
                "context_parallel_size",
                f"{type(base).__name__} has no rotary_emb to take the positions of a rank's tokens; use 1",
            )
        )
    if found:
        raise ConfigError(found)
    if hasattr(base, POSITIONS):  # prepared already
        return
    held = _Positions()
    setattr(base, POSITIONS, held)
    base.rotary_emb.register_forward_pre_hook(_global_positions(held), with_kwargs=True)
    lm.register_forward_pre_hook(_shifted_labels(held), with_kwargs=True)


def set_positions(model: nn.Module, positions: Tensor | None) -> None:
    lm: Any = hf_model(model)
    getattr(lm.base_model, POSITIONS).tokens = positions


def _global_positions(held: _Positions) -> Any:
    def hook(_: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if held.tokens is None:
            return None
        # rotary_emb(x, position_ids): the model counted 0 .. n-1 for this rank's n tokens
        return args[:1], {**kwargs, "position_ids": held.tokens}

    return hook


def _shifted_labels(held: _Positions) -> Any:
    def hook(_: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if held.tokens is None or kwargs.get("labels") is None:
            return None
        return args, {**kwargs, "shift_labels": kwargs["labels"]}

    return hook
