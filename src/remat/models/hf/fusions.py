"""What the compiled fast path (`HfFamily.use_kernels`) compiles in a transformers model beside
each Site's call (`compile_sites`): pure functions and leaf modules outside every Site, so every
plan composes with them.

- The rotary embedding: each attention module calls its modeling file's `apply_rotary_pos_emb`
  (about ten elementwise kernels each way, eager), compiled once per file.
- The MoE router (`gate` beside `experts`): softmax, top-k and renormalisation in one kernel.
- The routed experts (transformers' `grouped_mm` implementation): the tokens permuted to their
  experts and back by remat's deterministic Functions (`models/moe/dispatch.py`), whose backward
  gathers rows where indexing's would scatter-add them; the grouped GEMMs and the gate (the
  moe_act Site's module) as transformers runs them.

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
from remat.models.moe.dispatch import expert_offsets, permute, unpermute
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


GROUPED = "grouped_mm"
REMAT_GROUPED = "remat_grouped_mm"


def _grouped_experts(self: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped-GEMM experts with remat's permutation (the same rows, sums and order)."""
    from transformers.integrations import moe

    # transformers before 5.2x has no expert parallelism or post-expert norms on its experts
    if any(getattr(self, flag, False) for flag in ("_is_expert_parallel", "has_bias", "has_post_expert_norm")):
        return moe.grouped_mm_experts_forward(self, hidden, top_k_index, weights)
    topk, slots = top_k_index.size(-1), top_k_index.reshape(-1)
    rows, order, inverse = permute(hidden, slots, topk)
    counts = torch.histc(
        slots.int() if slots.is_cuda else slots.float(), bins=self.num_experts, min=0, max=self.num_experts - 1
    )
    offsets = expert_offsets(counts)
    up = moe._grouped_linear(
        rows, self.gate_up_proj if self.has_gate else self.up_proj, offsets, is_transposed=self.is_transposed
    )
    gated = self._apply_gate(up) if self.has_gate else self.act_fn(up)
    down = moe._grouped_linear(gated, self.down_proj, offsets, is_transposed=self.is_transposed)
    weighted = down * weights.reshape(-1)[order].unsqueeze(-1)
    return unpermute(weighted, order, inverse, topk).to(hidden.dtype)


def use_grouped_experts(model: nn.Module) -> int:
    """Run `model`'s routed experts that use transformers' grouped_mm through `_grouped_experts`;
    returns how many configs it switched."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if REMAT_GROUPED not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(REMAT_GROUPED, _grouped_experts)
    configs = {
        id(c): c for m in model.modules() if (c := getattr(getattr(m, "experts", None), "config", None)) is not None
    }
    switched = [c for c in configs.values() if getattr(c, "_experts_implementation", None) == GROUPED]
    for config in switched:
        config._experts_implementation = REMAT_GROUPED
    return len(switched)
