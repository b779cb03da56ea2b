"""Reference models (dense Llama-3 family) and named recipes."""
from remat.models.llama import LlamaConfig, LlamaModel, MLP, RMSNorm, SelfAttention, TransformerLayer
from remat.models.loss import LossKernels, chunked_linear_cross_entropy, compiled_loss_kernels
from remat.models.recipes import build, recipe_config, recipes

__all__ = [
    "LlamaConfig", "LlamaModel", "MLP", "RMSNorm", "SelfAttention", "TransformerLayer",
    "LossKernels", "build", "chunked_linear_cross_entropy", "compiled_loss_kernels", "recipe_config", "recipes",
]
