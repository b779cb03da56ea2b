"""What the compiled fast path (`HfFamily.use_kernels`) compiles in a transformers model beside
each Site's call (`compile_sites`): pure functions and leaf modules outside every Site, so every
plan composes with them.

- The rotary embedding: each attention module calls its modeling file's `apply_rotary_pos_emb`
  (about ten elementwise kernels each way, eager), compiled once per file.
- The MoE router (`gate` beside `experts`): softmax, top-k and renormalisation in one kernel.

Both swaps last for the process, as torch.compile's own caches do; the math is the eager one's.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat.models.hf.adapter import attention_modules
from remat.sites.site import Site

ROTARY = "apply_rotary_pos_emb"


def compile_rotary(model: nn.Module) -> int:
    """Compile the rotary embedding of every modeling file whose attention `model` runs; returns
    how many files it swapped."""
    swapped = 0
    for file in {sys.modules[type(m).__module__] for m in attention_modules(model)}:
        eager = getattr(file, ROTARY, None)
        if callable(eager) and not getattr(eager, "remat_compiled", False):
            compiled: Any = torch.compile(eager)
            compiled.remat_compiled = True
            setattr(file, ROTARY, compiled)
            swapped += 1
    return swapped


def compile_routers(model: nn.Module) -> int:
    """Compile each MoE block's router (its `gate`, holding no Site), one compiled forward per
    class; returns how many routers."""
    by_class: dict[type, Callable[..., Any]] = {}
    count = 0
    for block in model.modules():
        gate = getattr(block, "gate", None)
        if not isinstance(getattr(block, "experts", None), nn.Module) or not isinstance(gate, nn.Module):
            continue
        if any(isinstance(m, Site) for m in gate.modules()) or "forward" in gate.__dict__:
            continue
        compiled = by_class.setdefault(type(gate), torch.compile(type(gate).forward))
        gate.forward = functools.partial(compiled, gate)  # type: ignore[method-assign]
        count += 1
    return count
