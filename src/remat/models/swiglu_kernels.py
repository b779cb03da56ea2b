"""The Triton kernels behind remat.models.swiglu; imported only when they are first launched."""
import triton
import triton.language as tl


@triton.jit
def silu_mul_forward(gate_up, out, ffn, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ffn
    g = tl.load(gate_up + row * 2 * ffn + cols, mask=mask).to(tl.float32)
    u = tl.load(gate_up + row * 2 * ffn + ffn + cols, mask=mask).to(tl.float32)
    tl.store(out + row * ffn + cols, (g * tl.sigmoid(g) * u).to(out.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_backward(gate_up, grad, out, act, ffn, BLOCK: tl.constexpr):
    """Both halves of gate_up's gradient into `out`, and the activation again into `act`."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ffn
    g = tl.load(gate_up + row * 2 * ffn + cols, mask=mask).to(tl.float32)
    u = tl.load(gate_up + row * 2 * ffn + ffn + cols, mask=mask).to(tl.float32)
    d = tl.load(grad + row * ffn + cols, mask=mask).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(act + row * ffn + cols, (g * sig * u).to(act.dtype.element_ty), mask=mask)
    # d silu(g) / dg = sig * (1 + g * (1 - sig))
    tl.store(out + row * 2 * ffn + cols, (d * u * sig * (1 + g * (1 - sig))).to(out.dtype.element_ty), mask=mask)
    tl.store(out + row * 2 * ffn + ffn + cols, (d * g * sig).to(out.dtype.element_ty), mask=mask)
