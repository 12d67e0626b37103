"""One decode step's attention over the slot cache on a GPU, as a Triton kernel: each (row, head)
reads its slot's keys and values in place, in blocks, with a running softmax (flash decoding without
the split over positions). PyTorch's ops would first gather every row's cache rows into a new tensor
(an indexed copy per layer for keys and one for values), then multiply, reduce and softmax through
it: on an H200 those gathers alone were a third of a 64-row GPT-2-small step.

`attend` is `nanoserve::decode_attention`'s CUDA implementation (nanogpt/kernels/decode_attention.py);
Under TRITON_INTERPRET=1 (set before Triton is imported) the same kernel runs in Triton's interpreter
on CPU tensors, which is how the CPU test suite checks it (tests/test_decode_attention.py).
"""
import torch

try:  # PyTorch's CUDA builds bring Triton; without it a GPU attends with PyTorch's ops
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

BLOCK_KEYS = 64  # positions a program reads per iteration
NO_WINDOW = 1 << 30  # `window` of a layer that attends to every position before its own


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit(do_not_specialize=["span", "window"])
    def _decode_attention(q, cache_k, cache_v, out, slots, positions, span, scale, window,
                          sq_b, sq_h, sk_s, sk_h, sk_n, so_b, so_h, head_size,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program (b, h): out[b, h] = softmax(q[b, h] . K[slot, h, lo:hi]) V[slot, h, lo:hi], with
        hi = min(positions[b] + 1, span) and lo = max(hi - window, 0). The products and the softmax
        run in float32 whatever the cache's dtype."""
        b, h = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slots + b).to(tl.int64)
        hi = tl.minimum(tl.load(positions + b).to(tl.int32) + 1, span)
        lo = tl.maximum(hi - window, 0)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_size
        qv = tl.load(q + b * sq_b + h * sq_h + d, mask=d_ok, other=0.0).to(tl.float32)
        base = slot * sk_s + h * sk_h
        m = tl.full([1], float("-inf"), tl.float32)
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            at = base + n[:, None] * sk_n + d[None, :]
            ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(cache_k + at, mask=ok, other=0.0).to(tl.float32)
            s = tl.sum(k * qv[None, :], axis=1) * scale
            s = tl.where(n_ok, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            shrink = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(cache_v + at, mask=ok, other=0.0).to(tl.float32)
            acc = acc * shrink + tl.sum(p[:, None] * v, axis=0)
            total = total * shrink + tl.sum(p, axis=0)
            m = m_new
        tl.store(out + b * so_b + h * so_h + d, (acc / total).to(out.dtype.element_ty), mask=d_ok)


def attend(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor, span: int, scale: float, local: int) -> torch.Tensor:
    """q (B, heads, head size) -> (B, heads, head size) in q's dtype: row b attends to its slot's
    positions <= positions[b] (and > positions[b] - local where local > 0) among the first `span`.
    The cache is (slots, heads, positions, head size), its last dimension contiguous."""
    B, heads, size = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = q.new_empty(q.shape)
    if B == 0:
        return out
    assert cache_k.stride(-1) == 1 and cache_k.stride() == cache_v.stride()
    _decode_attention[(B, heads)](
        q, cache_k, cache_v, out, slots, positions, int(span), float(scale), int(local) if local > 0 else NO_WINDOW,
        q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        out.stride(0), out.stride(1), size,
        BLOCK_N=BLOCK_KEYS, BLOCK_D=triton.next_power_of_2(size))
    return out
