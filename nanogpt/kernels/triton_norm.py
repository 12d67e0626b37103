"""A residual add and the layer norm after it as one Triton kernel on a GPU: each program reads a row
of the residual stream and of a sub-layer's output, writes their sum (the stream the next sub-layer
adds to) and its layer norm. PyTorch runs these as two kernels, an add and a norm, each reading and
writing the row; a GPT-2-small decode step has 24 of each.

`add_layer_norm` serves the layer norms that nanogpt/kernels/norms.py swaps in on a GPU.
Under TRITON_INTERPRET=1 (set before Triton is imported) it runs in Triton's interpreter on CPU
tensors, which is how the CPU test suite checks it (tests/triton_interpreted.py).
"""
import torch

try:  # PyTorch's CUDA builds bring Triton; without it the add and the norm stay PyTorch's
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _add_layer_norm(x, y, weight, bias, total, normed, width, eps, sx, sy, st, sn,
                        HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        """Program r: total[r] = x[r] + y[r], rounded to the output's dtype as PyTorch's add rounds it;
        normed[r] = layer_norm(total[r]) * weight + bias, from that rounded sum, in float32."""
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        ok = c < width
        s = (tl.load(x + r * sx + c, mask=ok, other=0.0).to(tl.float32)
             + tl.load(y + r * sy + c, mask=ok, other=0.0).to(tl.float32))
        s = s.to(total.dtype.element_ty)
        tl.store(total + r * st + c, s, mask=ok)
        s = s.to(tl.float32)
        mean = tl.sum(s, axis=0) / width
        centered = tl.where(ok, s - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / width + eps)
        out = centered * rstd * tl.load(weight + c, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            out += tl.load(bias + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(normed + r * sn + c, out.to(normed.dtype.element_ty), mask=ok)


def add_layer_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, layer_norm(x + y, weight, bias, eps)) over the last dimension, both in x's dtype; x
    and y of one shape, their rows contiguous."""
    width = x.shape[-1]
    x2, y2 = x.reshape(-1, width), y.reshape(-1, width)
    x2, y2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x2, y2))
    total, normed = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0]:
        block = triton.next_power_of_2(width)  # a row a program: 8 values a thread, up to 8 warps
        _add_layer_norm[(x2.shape[0],)](
            x2, y2, weight, bias if bias is not None else weight, total, normed, width, float(eps),
            x2.stride(0), y2.stride(0), total.stride(0), normed.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 8))
    return total.view(x.shape), normed.view(x.shape)
