"""remat's Triton kernels (SwiGLU, RMSNorm, the loss chunk, the QKV split with RoPE); imported
only when one is first launched (remat.models.kernels.triton_ops)."""

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
def silu_mul_backward(gate_up, grad, out, ffn, BLOCK: tl.constexpr):
    """Both halves of gate_up's gradient into `out`, in one pass."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ffn
    g = tl.load(gate_up + row * 2 * ffn + cols, mask=mask).to(tl.float32)
    u = tl.load(gate_up + row * 2 * ffn + ffn + cols, mask=mask).to(tl.float32)
    d = tl.load(grad + row * ffn + cols, mask=mask).to(tl.float32)
    sig = tl.sigmoid(g)
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
def rms_norm_backward(x, weight, grad, rstd, dx, dw_partial, n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS rows from pid * ROWS on: their input gradient, and the sum of their weight gradients
    into dw_partial[pid]; one pass over x and grad for both."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    w = tl.load(weight + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        # past the last row no column is valid; a vector & a scalar comparison would come out
        # int32 in Triton 3.9's interpreter, which refuses such a mask
        mask = cols < tl.where(row < n_rows, n_cols, 0)
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
def cross_entropy_chunk(
    logits, labels, row_scale, losses, n_cols, NEED_GRAD: tl.constexpr, N_BLOCKS: tl.constexpr, BLOCK: tl.constexpr
):
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


@triton.jit
def _rotary_rows(
    src, src_rows, dst, dst_rows, mask, c1, c2, s1, s2, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, MODE: tl.constexpr
):
    """Rows of 2 * HALF at element offsets src_rows into dst_rows, each half a [rows, HALF_BLOCK]
    tile: MODE 1 rotate-half RoPE (y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2), MODE -1 its transpose
    (x1 = y1 c1 + y2 s2, x2 = y2 c2 - y1 s1), MODE 0 a copy."""
    d = tl.arange(0, HALF_BLOCK)[None, :]
    a = tl.load(src + src_rows[:, None] + d, mask=mask).to(tl.float32)
    b = tl.load(src + src_rows[:, None] + HALF + d, mask=mask).to(tl.float32)
    if MODE == 1:
        a, b = a * c1 - b * s1, b * c2 + a * s2
    elif MODE == -1:
        a, b = a * c1 + b * s2, b * c2 - a * s1
    tl.store(dst + dst_rows[:, None] + d, a.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + dst_rows[:, None] + HALF + d, b.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def rotary_qkv(
    fused,
    q,
    k,
    v,
    cos,
    sin,
    seq_len,
    HEADS: tl.constexpr,
    GROUPS: tl.constexpr,
    PER_GROUP: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    GROUPS_BLOCK: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    FORWARD: tl.constexpr,
):
    """One token. FORWARD: its fused projection row (per query group PER_GROUP query heads, a key
    and a value head) into q, k rotated and v copied; else q, k, v's gradients back into the fused
    row's gradient. cos and sin are [seq_len, 2 * HALF] tables."""
    tok = tl.program_id(0).to(tl.int64)
    head_dim: tl.constexpr = 2 * HALF
    d = tl.arange(0, HALF_BLOCK)
    table = (tok % seq_len) * head_dim + d
    c1 = tl.load(cos + table, mask=d < HALF).to(tl.float32)[None, :]
    c2 = tl.load(cos + table + HALF, mask=d < HALF).to(tl.float32)[None, :]
    s1 = tl.load(sin + table, mask=d < HALF).to(tl.float32)[None, :]
    s2 = tl.load(sin + table + HALF, mask=d < HALF).to(tl.float32)[None, :]
    fused_row = tok * GROUPS * (PER_GROUP + 2) * head_dim
    n = tl.arange(0, HEADS_BLOCK)
    q_slot = fused_row + ((n // PER_GROUP) * (PER_GROUP + 2) + n % PER_GROUP) * head_dim
    q_rows = tok * HEADS * head_dim + n * head_dim
    q_mask = (n < HEADS)[:, None] & (d < HALF)[None, :]
    g = tl.arange(0, GROUPS_BLOCK)
    k_slot = fused_row + (g * (PER_GROUP + 2) + PER_GROUP) * head_dim
    kv_rows = tok * GROUPS * head_dim + g * head_dim
    kv_mask = (g < GROUPS)[:, None] & (d < HALF)[None, :]
    if FORWARD:
        _rotary_rows(fused, q_slot, q, q_rows, q_mask, c1, c2, s1, s2, HALF, HALF_BLOCK, 1)
        _rotary_rows(fused, k_slot, k, kv_rows, kv_mask, c1, c2, s1, s2, HALF, HALF_BLOCK, 1)
        _rotary_rows(fused, k_slot + head_dim, v, kv_rows, kv_mask, c1, c2, s1, s2, HALF, HALF_BLOCK, 0)
    else:
        _rotary_rows(q, q_rows, fused, q_slot, q_mask, c1, c2, s1, s2, HALF, HALF_BLOCK, -1)
        _rotary_rows(k, kv_rows, fused, k_slot, kv_mask, c1, c2, s1, s2, HALF, HALF_BLOCK, -1)
        _rotary_rows(v, kv_rows, fused, k_slot + head_dim, kv_mask, c1, c2, s1, s2, HALF, HALF_BLOCK, 0)
