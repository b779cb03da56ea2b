"""Reference models (dense Llama-3 family) and named recipes."""
from remat.models.llama import LlamaConfig, LlamaModel, MLP, SelfAttention, TransformerLayer
from remat.models.loss import chunked_linear_cross_entropy
from remat.models.recipes import build, recipe_config, recipes

__all__ = [
    "LlamaConfig", "LlamaModel", "MLP", "SelfAttention", "TransformerLayer",
    "build", "chunked_linear_cross_entropy", "recipe_config", "recipes",
]
