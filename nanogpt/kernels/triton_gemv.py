"""A linear layer over a decode step's few rows (at most MAX_ROWS) as one Triton kernel on a GPU:
each program reads a block of the weight's rows once, in chunks along the input, and multiplies
every input row by it, accumulating in float32; the bias and a GELU (tanh or erf) or a ReLU are
applied to the accumulator before the output is written. At a few rows a linear layer reads its
weight and little else, so what it costs is how near the weight's bytes come to the memory's
bandwidth.

`norm_linear` is the same matmul fed by a layer norm in its own pass: each program normalizes the
rows (their residual sum first, which one program writes out) as it reads them, so the norm is no
kernel of its own. Each input row is small and read from the L2 cache by every program.

`linear` and `norm_linear` serve nanogpt/kernels/few_rows.py, which times them against cuBLAS (and
the norm's own kernel) per layer shape and row count on the GPU and swaps them in where faster.
Under TRITON_INTERPRET=1 (set before Triton is imported) they run in Triton's interpreter on CPU
tensors, which is how the CPU test suite checks them (tests/triton_interpreted.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

try:  # PyTorch's CUDA builds bring Triton; without it cuBLAS serves every row count
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

MAX_ROWS = 8
ACTIVATIONS = {None: 0, "gelu_tanh": 1, "relu": 2, "gelu": 3}


class Config(NamedTuple):
    """A program's block of weight rows (block_n) and of inputs per iteration (block_k), and its warps."""
    block_n: int
    block_k: int
    warps: int


# The blocks timed on the GPU (few_rows.py): narrow blocks give a layer of few outputs programs
# enough for every multiprocessor, wide chunks fewer iterations. Their product times the rows'
# block bounds the values a program holds at once. Each is a compile on a machine's first start.
# At a row or two a program's block is also what it has in flight from memory at once: the last
# two (of one or two rows) keep more of a large layer's weight in flight (GPT-2 XL's output
# projections: 200 programs of 8 rows for 1600 outputs).
CONFIGS = (Config(8, 512, 4), Config(16, 256, 4), Config(32, 128, 4), Config(8, 256, 4), Config(16, 128, 4),
           Config(8, 2048, 8), Config(4, 2048, 4))
MAX_BLOCK = 16384  # rows x block_n x block_k, at most


def available() -> bool:
    return triton is not None


def block_rows(rows: int) -> int:
    """The rows a program's block holds for `rows` rows (a power of two)."""
    return 1 << (rows - 1).bit_length() if rows > 1 else 1


def configs(rows: int) -> list[Config]:
    """The CONFIGS a kernel of `rows` rows may take."""
    return [c for c in CONFIGS if block_rows(rows) * c.block_n * c.block_k <= MAX_BLOCK]


if triton is not None:
    @triton.jit
    def _epilogue(acc, bias, n, n_ok, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
        if HAS_BIAS:
            acc += tl.load(bias + n, mask=n_ok, other=0.0).to(tl.float32)
        if ACTIVATION == 1:  # tanh GELU: 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)
            acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
        elif ACTIVATION == 2:
            acc = tl.maximum(acc, 0.0)
        elif ACTIVATION == 3:  # erf GELU (GPT-NeoX's): 0.5 x (1 + erf(x / sqrt(2)))
            acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
        return acc

    @triton.jit
    def _one_row(x, w, bias, y, N, K, swn, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program p: y[n] = act(sum_k x[k] w[n, k] + bias[n]) for its BLOCK_N outputs n."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        rows = w + n.to(tl.int64)[:, None] * swn
        acc = tl.zeros([BLOCK_N], tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            k_ok = k < K
            wt = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            xt = tl.load(x + k, mask=k_ok, other=0.0).to(tl.float32)
            acc += tl.sum(wt * xt[None, :], axis=1)
        acc = _epilogue(acc, bias, n, n_ok, HAS_BIAS, ACTIVATION)
        tl.store(y + n, acc.to(y.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _few_rows(x, w, bias, y, M, N, K, sxm, swn, sym, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program p: y[m, n] = act(sum_k x[m, k] w[n, k] + bias[n]) for the M rows m and its BLOCK_N
        outputs n, each chunk of the weight read once for every row."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        n_ok, m_ok = n < N, m < M
        rows = w + n.to(tl.int64)[:, None] * swn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            k_ok = k < K
            wt = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            xt = tl.load(x + m[:, None] * sxm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0).to(tl.float32)
            acc += tl.sum(xt[:, None, :] * wt[None, :, :], axis=2)
        acc = _epilogue(acc, bias, n[None, :], n_ok[None, :], HAS_BIAS, ACTIVATION)
        tl.store(y + m[:, None] * sym + n[None, :], acc.to(y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


    @triton.jit
    def _stream(x, y, m, k, ok, sxm, sym, HAS_Y: tl.constexpr):
        """The rows' residual stream at inputs k, float32: x, or x + y rounded to x's dtype as
        PyTorch's add rounds it."""
        s = tl.load(x + m[:, None] * sxm + k[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_Y:
            s += tl.load(y + m[:, None] * sym + k[None, :], mask=ok, other=0.0).to(tl.float32)
            s = s.to(x.dtype.element_ty).to(tl.float32)
        return s

    @triton.jit
    def _norm_rows(x, y, gamma, beta, total, w, bias, out, M, N, K, eps, sxm, sym, stm, swn, som,
                   HAS_Y: tl.constexpr, HAS_BETA: tl.constexpr, HAS_BIAS: tl.constexpr,
                   ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program p: out[m, n] = act(sum_k h[m, k] w[n, k] + bias[n]) for its BLOCK_N outputs n, h =
        layer_norm(x + y) rounded to x's dtype (as the norm's own kernel writes it); program 0 also
        writes total = x + y. The mean and variance are merged chunk by chunk (Chan et al.), one pass."""
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        n_ok, m_ok = n < N, m < M
        mean = tl.zeros([BLOCK_M], tl.float32)
        m2 = tl.zeros([BLOCK_M], tl.float32)
        seen = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            ok = m_ok[:, None] & (k < K)[None, :]
            s = _stream(x, y, m, k, ok, sxm, sym, HAS_Y)
            count = tl.sum(tl.where(k < K, 1.0, 0.0), axis=0)
            chunk_mean = tl.sum(s, axis=1) / count
            centered = tl.where(ok, s - chunk_mean[:, None], 0.0)
            delta = chunk_mean - mean
            mean += delta * count / (seen + count)
            m2 += tl.sum(centered * centered, axis=1) + delta * delta * seen * count / (seen + count)
            seen += count
        rstd = 1.0 / tl.sqrt(m2 / K + eps)
        rows = w + n.to(tl.int64)[:, None] * swn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            k_ok = k < K
            ok = m_ok[:, None] & k_ok[None, :]
            s = _stream(x, y, m, k, ok, sxm, sym, HAS_Y)
            if HAS_Y:
                if pid == 0:
                    tl.store(total + m[:, None] * stm + k[None, :], s.to(total.dtype.element_ty), mask=ok)
            h = (s - mean[:, None]) * rstd[:, None] * tl.load(gamma + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            if HAS_BETA:
                h += tl.load(beta + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            h = tl.where(ok, h.to(x.dtype.element_ty).to(tl.float32), 0.0)
            wt = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(h[:, None, :] * wt[None, :, :], axis=2)
        acc = _epilogue(acc, bias, n[None, :], n_ok[None, :], HAS_BIAS, ACTIVATION)
        tl.store(out + m[:, None] * som + n[None, :], acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
           config: Config) -> torch.Tensor:
    """activation(x @ weight.T + bias) for x (M, K), M at most MAX_ROWS, in x's dtype: weight (N, K)
    and bias (N,) of that dtype, the weight's rows contiguous; activation None, "gelu_tanh", "gelu"
    (erf) or "relu"."""
    M, K = x.shape
    N = weight.shape[0]
    assert 0 < M <= MAX_ROWS and weight.shape[1] == K and weight.stride(1) == 1, (x.shape, weight.shape)
    x = x if x.stride(1) == 1 else x.contiguous()
    y = x.new_empty(M, N)
    grid = (triton.cdiv(N, config.block_n),)
    flags = dict(HAS_BIAS=bias is not None, ACTIVATION=ACTIVATIONS[activation], BLOCK_N=config.block_n,
                 BLOCK_K=config.block_k, num_warps=config.warps)
    b = bias if bias is not None else weight
    if M == 1:
        _one_row[grid](x, weight, b, y, N, K, weight.stride(0), **flags)
    else:
        _few_rows[grid](x, weight, b, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
                        BLOCK_M=block_rows(M), **flags)
    return y


def norm_linear(x: torch.Tensor, y: torch.Tensor | None, norm_weight: torch.Tensor, norm_bias: torch.Tensor | None,
                eps: float, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, activation(layer_norm(x + y) @ weight.T + bias)) for x (M, K), M at most MAX_ROWS, in
    x's dtype; without y, (x, ... of x). norm_weight and norm_bias (K,): the layer norm's; weight (N, K)
    and bias (N,) as `linear` takes them."""
    M, K = x.shape
    N = weight.shape[0]
    assert 0 < M <= MAX_ROWS and weight.shape[1] == K and weight.stride(1) == 1, (x.shape, weight.shape)
    assert y is None or y.shape == x.shape, (x.shape, y.shape)
    x = x if x.stride(1) == 1 else x.contiguous()
    y = y if y is None or y.stride(1) == 1 else y.contiguous()
    total = x if y is None else torch.empty_like(x)
    out = x.new_empty(M, N)
    _norm_rows[(triton.cdiv(N, config.block_n),)](
        x, x if y is None else y, norm_weight, norm_bias if norm_bias is not None else norm_weight, total,
        weight, bias if bias is not None else weight, out, M, N, K, float(eps), x.stride(0),
        x.stride(0) if y is None else y.stride(0), total.stride(0), weight.stride(0), out.stride(0),
        HAS_Y=y is not None, HAS_BETA=norm_bias is not None, HAS_BIAS=bias is not None,
        ACTIVATION=ACTIVATIONS[activation], BLOCK_M=block_rows(M), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.warps)
    return total, out
