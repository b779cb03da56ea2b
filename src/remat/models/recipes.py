"""Named model recipes with the true Llama-3 shapes, plus a tiny one for tests and CPU runs."""
from __future__ import annotations

import difflib

import torch

from remat.models.llama import LlamaConfig, LlamaModel

_LLAMA3_VOCAB = 128256

# Recipe name -> LlamaConfig fields. Names containing "tiny" are CPU/test sized.
_RECIPES: dict[str, dict[str, int]] = {
    "llama3_8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                      num_query_groups=8, vocab_size=_LLAMA3_VOCAB, seq_length=8192),
    "llama3_70b": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                       num_attention_heads=64, num_query_groups=8, vocab_size=_LLAMA3_VOCAB,
                       seq_length=8192),
    "llama31_405b": dict(num_layers=126, hidden_size=16384, ffn_hidden_size=53248,
                         num_attention_heads=128, num_query_groups=8, vocab_size=_LLAMA3_VOCAB,
                         seq_length=8192),
    "llama3_tiny": dict(num_layers=4, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                        num_query_groups=2, vocab_size=512, seq_length=64),
}


def recipes() -> list[str]:
    """Names accepted by recipe_config() and build()."""
    return list(_RECIPES)


def _unknown(kind: str, name: str, valid: list[str]) -> ValueError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ValueError(f"unknown {kind} {name!r}; {hint}valid: {', '.join(valid)}")


def recipe_config(name: str, **overrides: object) -> LlamaConfig:
    """The recipe's LlamaConfig with any field replaced by an override (Megatron names)."""
    if name not in _RECIPES:
        raise _unknown("recipe", name, recipes())
    valid = list(LlamaConfig.field_names())
    for key in overrides:
        if key not in valid:
            raise _unknown("override", key, valid)
    return LlamaConfig(**{**_RECIPES[name], **overrides})  # type: ignore[arg-type]


def build(recipe: str, *, dtype: torch.dtype | None = None,
          device: torch.device | str | None = None, **overrides: object) -> LlamaModel:
    """A freshly initialized model of the recipe; device="meta" allocates nothing."""
    return LlamaModel(recipe_config(recipe, **overrides), dtype=dtype, device=device)
