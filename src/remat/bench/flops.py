"""Model FLOPs per step, counted as the anchor (../shared/anchors/torch_baseline.py) counts them."""
from __future__ import annotations

from remat.models import LlamaConfig


def model_flops(config: LlamaConfig, tokens_per_seq: int, sequences: int) -> float:
    """Forward+backward FLOPs of the model's matmuls, recompute not counted.

    6 x (layer parameters + output layer) x tokens for the dense part (the embedding lookup is
    not a matmul), plus 6 x layers x 2 x batch x seq^2 x hidden for attention (QK^T and PV,
    without halving for the causal mask, as the anchor does).
    """
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.head_dim
    layer_params = 2 * h * h + 2 * h * config.num_query_groups * d + 3 * h * f
    dense = 6 * (config.num_layers * layer_params + h * config.vocab_size) * sequences * tokens_per_seq
    attention = 6 * config.num_layers * 2 * sequences * tokens_per_seq**2 * h
    return float(dense + attention)
