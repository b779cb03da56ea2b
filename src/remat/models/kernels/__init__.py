"""Fast pieces the model families share: fused Functions with Triton kernels on CUDA (SwiGLU, the
QKV split with RoPE, RMSNorm, the chunked loss head) and the weight-gradient-accumulating linear.
Each runs anywhere: a plain torch fallback off CUDA, allocation only on the meta device."""
