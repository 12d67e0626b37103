"""torch.compile of the model's decode step (`forward_decode`), its graphs called without dynamo
once compiled (`DirectCall`), and where the worker compiles it without being told."""
from __future__ import annotations

import logging
import os
import shutil
import types

import torch

from nanogpt.runtime import compile_cache

log = logging.getLogger(__name__)


def compile_decode(model):
    """The compiled `model.forward_decode`, its graphs kept in the compile cache that outlives the
    process (compile_cache.py). Without inductor's weight freezing: the prepacked layers of
    nanogpt/kernels/ are one opaque op each inside the graph, and a frozen graph could not be
    cached. The recompile limit is a setting of the whole process.

    On a CPU the graph's wrapper is inductor's C++ one: the step's few hundred calls around its
    kernels (buffers, views, the opaque layers) run in C++ rather than Python, a few percent off
    every precision's step (docs/notes/compiled-decode.md#c-wrapper); its first compile takes
    longer (the wrapper is compiled too), later starts load it from the cache as fast."""
    # every batch size a caller pads to is a graph, and so is each model of the process
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compile_cache.enable()
    options = {"cpp_wrapper": True} if torch.device(model.device).type == "cpu" else None
    return torch.compile(model.forward_decode, options=options)


class DirectCall:
    """One graph of a compiled `forward_decode` (compile_decode's), called without dynamo: the
    code dynamo made of the step for that graph (its arguments handed to the compiled graph) run
    as a plain function. Dynamo would first evaluate the frame and its guards, on every module and
    parameter of the model, a cost every step pays whatever its rows
    (docs/notes/compiled-decode.md#direct-calls).

    The graph's guards are checked at the first call of each kind of inputs (their sizes but the
    span, the one size that varies within a graph's calls, their dtypes, grad mode); that covers
    the served model's modules and weights too, as a served model never changes them. A call they
    refuse is not served (`__call__` returns None: the caller calls the compiled step, which
    compiles for it)."""

    def __init__(self, compiled, args: tuple):
        """The graph that served `compiled(*args)` (a call that ran)."""
        inline = getattr(compiled, "_torchdynamo_inline", None)  # the frame dynamo compiled
        if inline is None:
            raise NotImplementedError("not a torch.compile'd function")
        self._locals = dict(zip(inline.__code__.co_freevars, (c.cell_contents for c in inline.__closure__ or ())))
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(inline.__code__)
        entry = next((e for e in entries if e.guard_manager.check(self._f_locals(args))), None)
        if entry is None:
            raise LookupError("no compiled graph serves these inputs")
        self._guards = entry.guard_manager
        self._fn = types.FunctionType(entry.code, inline.__globals__, inline.__name__, inline.__defaults__,
                                      inline.__closure__)
        self._checked: dict[tuple, bool] = {}

    def _f_locals(self, args: tuple) -> dict:
        return {"args": args, "kwargs": {}, **self._locals}

    def __call__(self, tokens, slots, positions, cache, keys, out=None) -> torch.Tensor | None:
        args = (tokens, slots, positions, cache, keys, out)
        kind = (torch.is_grad_enabled(), keys.dtype,
                *((None, None) if t is None else (t.shape[0], t.dtype) for t in (tokens, slots, positions, out)))
        ok = self._checked.get(kind)
        if ok is None:
            ok = self._checked[kind] = self._guards.check(self._f_locals(args))
            if not ok:
                log.warning("a compiled decode graph refused its inputs; the step runs through dynamo",
                            extra={"inputs": str(kind)})
        return self._fn(*args) if ok else None


# The precisions (precision.py's names) whose compiled decode step was measured ahead of the eager
# one on a CPU under serving load (docs/notes/compiled-decode.md#default); the GPU's
# compiled step has not been measured.
COMPILED_ON_CPU = ("float32", "bfloat16", "int8")


def compiles_by_default(device, precision: str) -> bool:
    """Whether a worker compiles its decode step unless told otherwise: for COMPILED_ON_CPU on a
    CPU, and only where inductor finds the C++ compiler it builds its kernels with."""
    return (torch.device(device).type == "cpu" and precision in COMPILED_ON_CPU
            and shutil.which(os.environ.get("CXX", "g++")) is not None)
