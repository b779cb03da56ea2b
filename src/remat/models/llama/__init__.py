"""The dense Llama-3 family: Megatron Core's module and config names, remat Sites, true-shape recipes."""

from remat.models.llama.config import LlamaConfig
from remat.models.llama.family import FAMILY, LlamaFamily
from remat.models.llama.model import MLP, LlamaModel, RMSNorm, SelfAttention, TransformerLayer

__all__ = ["FAMILY", "LlamaConfig", "LlamaFamily", "LlamaModel", "MLP", "RMSNorm", "SelfAttention", "TransformerLayer"]
