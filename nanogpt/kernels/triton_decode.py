"""One decode step's attention over the slot cache on a GPU, as a Triton kernel: each (row, head)
writes its new key and value into its slot and reads the slot's earlier keys and values in place,
in blocks, with a running softmax (flash decoding without the split over positions). PyTorch's ops
would write the step's keys and values by two indexed copies a layer, gather every row's cache rows
into a new tensor, then multiply, reduce and softmax through it (what that costs a GPU step:
docs/notes/decode-attention.md#gpu).

`write_and_attend` is `nanoserve::decode_attention_write`'s CUDA implementation
(nanogpt/kernels/decode_attention.py). Under TRITON_INTERPRET=1 (set before Triton is imported) the
same kernel runs in Triton's interpreter on CPU tensors, which is how the CPU test suite checks it
(tests/triton_interpreted.py).
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
    def _decode_attention(q, k_new, v_new, cache_k, cache_v, out, slots, positions, span, scale, window,
                          sq_b, sq_h, snk_b, snk_h, snv_b, snv_h, sk_s, sk_h, sk_n, so_b, so_h, head_size,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program (b, h): write row b's new key and value of head h at its slot's position p =
        positions[b], then out[b, h] = softmax(q . K[slot, h, lo:p + 1]) V[slot, h, lo:p + 1] with
        lo = max(p + 1 - window, 0). p's key and value come from the inputs, and so do those of
        the positions that rows before b write in this step (a prompt chunk fed as rows: its slot's
        positions p - j at rows b - j); every other position from the cache, which no program of
        this step writes there. Products and softmax in float32."""
        b, h = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slots + b).to(tl.int64)
        pos = tl.minimum(tl.load(positions + b).to(tl.int32), span - 1)
        lo = tl.maximum(pos + 1 - window, 0)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_size
        qv = tl.load(q + b * sq_b + h * sq_h + d, mask=d_ok, other=0.0).to(tl.float32)
        base = slot * sk_s + h * sk_h
        k_cur = tl.load(k_new + b * snk_b + h * snk_h + d, mask=d_ok, other=0.0)
        v_cur = tl.load(v_new + b * snv_b + h * snv_h + d, mask=d_ok, other=0.0)
        tl.store(cache_k + base + pos * sk_n + d, k_cur, mask=d_ok)
        tl.store(cache_v + base + pos * sk_n + d, v_cur, mask=d_ok)
        # the running softmax starts from the new position's own score
        m = tl.zeros([1], tl.float32) + tl.sum(k_cur.to(tl.float32) * qv, axis=0) * scale
        total = tl.full([1], 1.0, tl.float32)
        acc = v_cur.to(tl.float32)
        # before `split` no row of this step writes this slot: a chunk's row p - j is row b - j
        split = tl.maximum(pos - b, lo)
        for start in range(lo, pos, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < pos
            at = base + n[:, None] * sk_n + d[None, :]
            ok = n_ok[:, None] & d_ok[None, :]
            if start + BLOCK_N <= split:
                k = tl.load(cache_k + at, mask=ok, other=0.0).to(tl.float32)
                v = tl.load(cache_v + at, mask=ok, other=0.0).to(tl.float32)
            else:  # the row that would write position n in this step, and whether it does
                r = tl.maximum(b - pos + n, 0)
                fresh = (n_ok & (n >= split) & (tl.load(slots + r, mask=n_ok, other=-1).to(tl.int64) == slot)
                         & (tl.minimum(tl.load(positions + r, mask=n_ok, other=-1).to(tl.int32), span - 1) == n))
                new = ok & fresh[:, None]
                k = tl.where(new, tl.load(k_new + r[:, None] * snk_b + h * snk_h + d[None, :], mask=new, other=0.0),
                             tl.load(cache_k + at, mask=ok & ~new, other=0.0)).to(tl.float32)
                v = tl.where(new, tl.load(v_new + r[:, None] * snv_b + h * snv_h + d[None, :], mask=new, other=0.0),
                             tl.load(cache_v + at, mask=ok & ~new, other=0.0)).to(tl.float32)
            s = tl.sum(k * qv[None, :], axis=1) * scale
            s = tl.where(n_ok, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            shrink = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            acc = acc * shrink + tl.sum(p[:, None] * v, axis=0)
            total = total * shrink + tl.sum(p, axis=0)
            m = m_new
        tl.store(out + b * so_b + h * so_h + d, (acc / total).to(out.dtype.element_ty), mask=d_ok)


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                     cache_v: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, span: int,
                     scale: float, local: int) -> torch.Tensor:
    """Write k, v (B, heads, head size) at each row's slot and position of the cache (slots, heads,
    positions, head size; its last dimension contiguous), and attend q (B, heads, head size) of row
    b to its slot's positions <= positions[b] (and > positions[b] - local where local > 0): (B,
    heads, head size) in q's dtype. Rows may share a slot as a prompt chunk's tokens do: at
    consecutive positions in consecutive rows, each then seeing the ones before it; padding rows
    share one at position 0, with equal keys and values."""
    B, heads, size = q.shape
    # in the cache's dtype before the kernel, rounded as PyTorch rounds (a no-op where they agree)
    k, v = k.to(cache_k.dtype), v.to(cache_v.dtype)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = q.new_empty(q.shape)
    if B == 0:
        return out
    assert cache_k.stride(-1) == 1 and cache_k.stride() == cache_v.stride()
    _decode_attention[(B, heads)](
        q, k, v, cache_k, cache_v, out, slots, positions, int(span), float(scale),
        int(local) if local > 0 else NO_WINDOW,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        out.stride(0), out.stride(1), size,
        BLOCK_N=BLOCK_KEYS, BLOCK_D=triton.next_power_of_2(size))
    return out
