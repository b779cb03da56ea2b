"""remat's Triton kernels (SwiGLU, RMSNorm, the loss chunk); imported only when one is first launched
(remat.models.triton_ops)."""
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


@triton.jit
def rms_norm_forward(x, weight, y, rstd, n_cols, eps, BLOCK: tl.constexpr):
    """One row: y = x / rms(x) * weight, and 1 / rms(x) (float32) for backward."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    v = tl.load(x + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / n_cols + eps)
    w = tl.load(weight + cols, mask=mask).to(tl.float32)
    tl.store(y + row * n_cols + cols, (v * r * w).to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + row, r)


@triton.jit
def rms_norm_backward(x, weight, grad, rstd, dx, dw_partial, n_rows, n_cols, ROWS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """ROWS rows from pid * ROWS on: their input gradient, and the sum of their weight gradients
    into dw_partial[pid]; one pass over x and grad for both."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    w = tl.load(weight + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        mask = (cols < n_cols) & (row < n_rows)
        offsets = row.to(tl.int64) * n_cols + cols
        v = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(rstd + row, mask=row < n_rows, other=0.0)
        x_hat = v * r
        gw = g * w
        # d/dx of x * r(x) * w: r * (g * w - x_hat * mean(g * w * x_hat))
        c = tl.sum(gw * x_hat, axis=0) / n_cols
        tl.store(dx + offsets, ((gw - x_hat * c) * r).to(dx.dtype.element_ty), mask=mask)
        dw += g * x_hat
    tl.store(dw_partial + pid.to(tl.int64) * n_cols + cols, dw, mask=cols < n_cols)


@triton.jit
def cross_entropy_chunk(logits, labels, row_scale, losses, n_cols, NEED_GRAD: tl.constexpr,
                        N_BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    """One row of logits: its loss logsumexp - logit[label] into losses, and (NEED_GRAD) the
    gradient (softmax - onehot) * row_scale written over the logits. Two passes over the row;
    the second finds it in L2 when few rows run at once. Logits finite, labels in [0, n_cols)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * n_cols
    m = float("-inf")
    total = 0.0
    for i in range(N_BLOCKS):  # online logsumexp
        cols = i * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(v, axis=0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(v - m_new), axis=0)
        m = m_new
    lse = m + tl.log(total)
    label = tl.load(labels + row)
    tl.store(losses + row, lse - tl.load(base + label).to(tl.float32))
    if NEED_GRAD:
        scale = tl.load(row_scale + row)
        for i in range(N_BLOCKS):
            cols = i * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_cols
            v = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(v - lse) - tl.where(cols == label, 1.0, 0.0)
            tl.store(base + cols, (g * scale).to(base.dtype.element_ty), mask=mask)
