"""Shared by the unit and integration tests of adapt."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIM, FFN, HEADS, VOCAB, LAYERS, BATCH, SEQ = 32, 64, 4, 97, 3, 2, 12


class Attention(nn.Module):
    """What core attention is in torchtitan: a module of its own around SDPA."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).triu(1)
        probs = F.dropout(scores.masked_fill(mask, float("-inf")).softmax(-1), self.dropout, self.training)
        return probs @ v


class SelfAttention(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.inner_attention = Attention(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(self.inner_attention(q, k, v).transpose(1, 2).reshape(b, s, DIM))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = SelfAttention(dropout), FeedForward()
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attention(self.attention_norm(x)), self.dropout, self.training)
        return x + F.dropout(self.feed_forward(self.ffn_norm(x)), self.dropout, self.training)


class Transformer(nn.Module):
    """torchtitan's shape: layers in a ModuleDict keyed by index, loss from (tokens, labels)."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block(dropout) for i in range(LAYERS)})
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            x = layer(x)
        return F.cross_entropy(self.output(self.norm(x)).flatten(0, 1), labels.flatten())


SITE_MAP = {
    "layer": "layers.*",
    "layernorm": ["layers.*.attention_norm", "layers.*.ffn_norm"],
    "core_attn": "layers.*.attention.inner_attention",
    "mlp": "layers.*.feed_forward",
}


SELECTIVE = ["core_attn", "layernorm", "mlp"]


def _model(dropout: float = 0.1) -> Transformer:
    torch.manual_seed(0)
    return Transformer(dropout).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def titan_model() -> tuple[Transformer, dict]:
    """A factory for `--model helpers.adapt:titan_model`: the model and its site map."""
    return Transformer(dropout=0.0), SITE_MAP
