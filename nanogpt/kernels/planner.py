"""The kernel plan: which matmul kernel (matmuls.py) serves which row counts of a model's linear
layers, chosen per machine when the model is loaded.

A decode step multiplies a few rows (one per running sequence) by every weight matrix, and which
kernel does that fastest depends on the CPU and on the row count. So `pack_linears` times the
kernels this machine offers on a sample of the model's own weights at a few row counts (1-5 s for
GPT-2 small), and every nn.Linear then holds the chosen kernel's packed weight (linear.py) and uses
it for the row counts where no kernel that needs no pack (F.linear, the GEMV) serves them better.
Where the timing cannot be trusted (other processes busy), a rule measured on this project's CPUs
decides (RULE). docs/notes/kernel-plan.md has the measurements behind each choice.

A plan measured on a quiet machine is kept on disk where the worker asks for it (`keep_plans`), keyed
by the CPU, the thread count and the layers' shapes (in a directory per version of the code and
torch): a later start on the same machine reads it instead of timing again.

A packed copy costs as much memory as the weights it packs. Under torch.compile a packed layer is
one opaque op (ops.py), so compiled graphs run the same kernels and stay storable in the compile
cache (nanogpt/runtime/compile_cache.py).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn import functional as F

from nanogpt.kernels import gemv, machine
from nanogpt.kernels.linear import KernelLinear
from nanogpt.kernels.matmuls import (GEMV, GEMV_IN_ORDER, INT8, INT8_GEMV, KERNELS, ONEDNN_ACTIVATIONS, PLAIN, Plan,
                                     available)
from nanogpt.kernels.quantize import Int8Linear

log = logging.getLogger(__name__)

# Row counts timed when choosing; each stands for the rows up to the geometric mean with the next
# (1: 1-2, 4: 3-5, 8: 6-22, 64: 23-128, 256: the rest): one sequence, a few, a small batch, a large
# batch, a prefill chunk. 4 is timed apart: the GEMV's lead is largest there on some CPUs
# (docs/notes/kernel-plan.md#timed-rows).
TIMED_ROWS = (1, 4, 8, 64, 256)
# The sample of the model's weights timed: the first layers up to this size or twice the CPU's
# last-level cache, whichever is larger (`sample_bytes`), so that the timed weights stream from
# memory as in a real step rather than sit in the cache.
SAMPLE_BYTES = 32 << 20
# The most memory read between two timed passes that read the same weights (`_evictor`)
EVICT_BYTES = 256 << 20
# Timing stops repeating after this many seconds (at least one timed pass each), so that a busy
# machine does not hold up a start for long.
TIME_BUDGET = 1.0
ENV = "NANOSERVE_KERNEL"  # force one kernel at every row count (benchmarks, diagnosis)
# Where the timing cannot be trusted, the first available of these serves every row count, except
# up to gemv.ROWS rows, which the project's own GEMV serves where it is built (int8: its int8 GEMV,
# before INT8): the order measured on this project's CPUs (docs/notes/kernel-ops.md#rule).
RULE = ("onednn", "mkl", PLAIN)
# A GELU leaves the packed kernel's own pass only where that pass was this much slower
# (`gelu_fuses`): fused saves an operator call and a pass over the output, which the timing of one
# layer ignores.
GELU_MARGIN = 1.1


def pack_linears(model: nn.Module, kernel: str | None = None) -> int:
    """Give every CPU float32 / bfloat16 nn.Linear of `model` the fastest kernel this machine has
    for it (in place: the class of the same module object changes; parameters, weight tying and
    state_dict stay as they are), and repack those whose weights changed since; likewise every
    int8 layer (quantize.py) the fastest int8 kernel for each row count. The kernel is chosen by
    timing (`choose`), or forced by `kernel` or the NANOSERVE_KERNEL environment variable. Returns
    how many layers hold a current pack (0 where plain F.linear won)."""
    kernel = kernel or os.environ.get(ENV) or None
    layers = [m for m in model.modules() if type(m) in (nn.Linear, KernelLinear)
              and m.weight.device.type == "cpu" and m.weight.dtype in (torch.float32, torch.bfloat16)]
    count = 0
    for dtype in {m.weight.dtype for m in layers}:
        for group in _planned_together(model, [m for m in layers if m.weight.dtype == dtype]):
            plan = Plan.only(_check(kernel, dtype)) if kernel else \
                choose(group, gelu=getattr(model, "output_layer", None) not in group)
            for module in group:
                if type(module) is nn.Linear:
                    module.__class__ = KernelLinear
                    module._plan = None
                if module._plan != plan or not module.is_current():
                    module.set_plan(plan)
                count += plan.packed != PLAIN
    for group in _planned_together(model, [m for m in model.modules() if isinstance(m, Int8Linear)]):
        plan = Plan.only(_check(kernel, torch.qint8)) if kernel else choose(group)
        for module in group:
            if module._plan != plan or module._packed_from is not module._packed_params._packed_params:
                module.set_plan(plan)
        count += len(group)
    return count


def _planned_together(model: nn.Module, layers: list[nn.Module]) -> list[list[nn.Module]]:
    """The groups of `layers` that share one plan: the output head (a serving model's
    `output_layer`, vocabulary x width) on its own, the others together: kernels cross over at
    other row counts on the head's shape (docs/notes/kernel-plan.md#head)."""
    head = getattr(model, "output_layer", None)
    groups = [[m for m in layers if m is not head], [m for m in layers if m is head]]
    return [group for group in groups if group]


def _plans_of(model: nn.Module) -> dict[str, Plan]:
    """{weight dtype's name ("int8" for int8 layers; "... head" for the output head's): plan} of the
    model's planned layers, the blocks' first."""
    head = getattr(model, "output_layer", None)
    plans = {}
    for m in model.modules():
        if isinstance(m, (KernelLinear, Int8Linear)) and m._plan is not None:
            dtype = "int8" if isinstance(m, Int8Linear) else str(m.weight.dtype).removeprefix("torch.")
            plans.setdefault(dtype + " head" if m is head else dtype, m._plan)
    return dict(sorted(plans.items(), key=lambda item: item[0].endswith(" head")))


def describe(model: nn.Module) -> str | None:
    """The plans of the model's packed layers, for a log line (None when it has none)."""
    return "; ".join(f"{dtype}: {plan.describe()}" for dtype, plan in _plans_of(model).items()) or None


def row_costs(model: nn.Module) -> dict[int, float] | None:
    """How the cost of the model's weight matmuls grows with the rows of a forward: {rows: seconds}
    of the timed sample at TIMED_ROWS, each with the kernel its plan gives those rows (None where
    no plan was timed: forced, GPU)."""
    plan = next((plan for plan in _plans_of(model).values() if plan.seconds), None)
    if plan is None:
        return None
    return {rows: plan.seconds[plan.kernel_for(rows).name][rows] for rows in _timed_rows(plan.seconds)}


def _check(name: str, dtype: torch.dtype) -> str:
    if name not in available(dtype):
        raise ValueError(f"kernel {name!r} does not run {str(dtype).removeprefix('torch.')} here; "
                         f"available: {', '.join(available(dtype))}")
    return name


# ---- choosing by measurement ----

_plans: dict[tuple, Plan] = {}  # one measurement per weight shapes, dtype and thread count
_kept: Path | None = None  # where measured plans outlive the process (`keep_plans`)


def keep_plans(directory: str | Path | None) -> None:
    """Keep every plan measured on a quiet machine in `directory`, and read one from there instead
    of timing (None: neither). The directory should be one per version of the code and torch (the
    worker's is in its compile cache's: nanogpt/runtime/compile_cache.py)."""
    global _kept
    _kept = None if directory is None else Path(directory)


def _kept_path(key: tuple) -> Path:
    digest = hashlib.sha256(f"{machine.cpu_identity()}\n{key}".encode()).hexdigest()[:24]
    return _kept / f"{digest}.json"


def _read_kept(key: tuple) -> Plan | None:
    try:
        kept = json.loads(_kept_path(key).read_text())
        ranges = tuple((math.inf if most is None else most, name) for most, name in kept["ranges"])
        seconds = {name: {int(rows): t for rows, t in by_rows.items()} for name, by_rows in kept["seconds"].items()}
        plan = Plan(kept["packed"], ranges, seconds, "measured before on this CPU", kept["fused_gelu"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    usable = available(key[0])  # a kernel whose build failed since is not offered now
    return plan if all(name in usable for _, name in plan.ranges) and plan.packed in [*usable, PLAIN] else None


def _keep(key: tuple, plan: Plan) -> None:
    path = _kept_path(key)
    record = {**asdict(plan), "ranges": [(None if most == math.inf else most, name) for most, name in plan.ranges]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(record))
        os.replace(partial, path)  # whole or absent for a process reading it at the same time
    except OSError as error:
        log.warning("kernel plan not kept: %s", error)


def choose(layers: list[nn.Module], gelu: bool = False) -> Plan:
    """Time every available kernel on a sample of `layers` (all float32, all bfloat16 or all int8)
    at TIMED_ROWS and choose from the timings (`plan_from`, `plan_int8`); timings taken while
    other processes were busy give way to RULE (int8: INT8). `gelu`: the layers include MLPs'
    first layers, whose GELU the packed kernel may take into its pass (`gelu_fuses`)."""
    int8 = isinstance(layers[0], Int8Linear)
    # int8's kernels both read packed int8 weights, which a cached sample favours alike, and each
    # int8 layer timed costs a repacking: the fixed sample there
    sample = _sample(layers, SAMPLE_BYTES if int8 else sample_bytes())
    weights = [(m.weight().dequantize(), m.bias()) if int8 else
               (m.weight.detach(), None if m.bias is None else m.bias.detach()) for m in sample]
    dtype = torch.qint8 if int8 else weights[0][0].dtype
    key = (dtype, tuple(tuple(w.shape) for w, _ in weights), torch.get_num_threads(), gelu)
    if key not in _plans and _kept is not None:
        kept = _read_kept(key)
        if kept is not None:
            _plans[key] = kept
    if key not in _plans:
        others = machine.OtherProcesses()
        seconds = time_kernels(weights, available(dtype), TIMED_ROWS)
        busy = others.cores()
        if others.quiet():
            plan = plan_int8(seconds) if int8 else plan_from(seconds)
            if gelu and not int8:
                fused = gelu_fuses(weights, plan)
                if others.quiet():  # still quiet while the GELU was timed
                    plan = replace(plan, fused_gelu=fused)
            _plans[key] = plan
            if _kept is not None:
                _keep(key, plan)
        else:
            source = f"rule: other processes used {busy:.1f} cores while timing"
            packed = INT8 if int8 else next(name for name in RULE if name in seconds)
            _plans[key] = Plan(packed, tuple((most, _rule(seconds, packed, r)) for most, r in _row_ranges(seconds)),
                               seconds, source)
    return _plans[key]


def _rule(seconds: dict[str, dict[int, float]], packed: str, rows: int, measured: bool = False) -> str:
    """The kernel RULE gives `rows` where the kernels timed in `seconds` are available and `packed`
    is packed (INT8: int8's). `measured`: the timings can be trusted, and the GEMV's rows go to
    whichever of its two orders of reading the weight was faster (the same sums: no margin;
    docs/notes/gemv.md#in-order)."""
    own = INT8_GEMV if packed == INT8 else GEMV
    if own == GEMV and measured and GEMV_IN_ORDER in seconds and seconds[GEMV_IN_ORDER][rows] < seconds[GEMV][rows]:
        own = GEMV_IN_ORDER
    return own if own in seconds and rows <= gemv.ROWS else packed


def _timed_rows(seconds: dict[str, dict[int, float]]) -> list[int]:
    return sorted(next(iter(seconds.values())))


def _row_ranges(seconds: dict[str, dict[int, float]]) -> list[tuple[float, int]]:
    """(most rows, timed rows) for each timed row count: it stands for the rows up to the geometric
    mean with the next."""
    rows = _timed_rows(seconds)
    return [(math.floor(math.sqrt(r * rows[i + 1])) if i + 1 < len(rows) else math.inf, r) for i, r in enumerate(rows)]


def plan_from(seconds: dict[str, dict[int, float]]) -> Plan:
    """The plan measured times {kernel: {rows: seconds}} give (PLAIN among the kernels): RULE's
    kernels unless the timings clearly say otherwise, i.e. another packed kernel was MARGIN times
    faster over all row counts (it is packed instead), or at some row count another kernel was
    MARGIN times faster than the rule's (it serves those rows; no pack is made where kernels
    that need none serve them all)."""
    plain = seconds[PLAIN]
    rows = sorted(plain)
    relative = {name: sum(by_rows[r] / plain[r] for r in rows) for name, by_rows in seconds.items()}
    unpacked = [name for name in seconds if KERNELS[name].pack is None]
    packed = next(name for name in RULE if name in seconds)
    challenger = min((name for name in relative if name not in unpacked and name != packed), key=relative.get,
                     default=None)
    if challenger and relative[challenger] * machine.MARGIN < relative[packed]:
        packed = challenger
    ranges = []
    for most, r in _row_ranges(seconds):
        rule = _rule(seconds, packed, r, measured=True)
        fastest = min([*unpacked, packed], key=lambda name: seconds[name][r])
        ranges.append((most, fastest if seconds[fastest][r] * machine.MARGIN < seconds[rule][r] else rule))
    if all(name == PLAIN for _, name in ranges):
        return Plan(PLAIN, ((math.inf, PLAIN),), seconds)
    if all(name != packed for _, name in ranges):
        packed = PLAIN
    return Plan(packed, tuple(ranges), seconds)


def gelu_fuses(weights: list[tuple[torch.Tensor, torch.Tensor | None]], plan: Plan) -> bool:
    """Whether `plan`'s packed kernel should apply a GELU in its own pass over the output rather than
    leave it to an operator of its own, timed on the widest of `weights` (an MLP's first layer) at
    the TIMED_ROWS the kernel serves: fused unless that pass was GELU_MARGIN times slower, as it
    was for oneDNN on a CPU without AVX-512 (docs/notes/kernel-plan.md#gelu)."""
    kernel = KERNELS[plan.packed]
    rows = [r for most, r in _row_ranges(plan.seconds) if plan.kernel_for(r).name == plan.packed] if plan.seconds else []
    if kernel.with_activation is None or not rows:
        return True
    w, b = max(weights, key=lambda wb: (wb[0].shape[0] > wb[0].shape[1], wb[0].numel()))
    packed, gelu = kernel.pack_of(w, b), ONEDNN_ACTIVATIONS[("GELU", "tanh")]
    fused = separate = 0.0
    with torch.no_grad():
        for r in rows:
            x = torch.randn(r, w.shape[1], dtype=w.dtype)
            fused += machine.best_seconds(lambda: kernel.with_activation(x, packed, w, b, gelu), 3, 0.01)
            separate += machine.best_seconds(lambda: F.gelu(kernel.linear(x, packed, w, b), approximate="tanh"), 3,
                                             0.01)
    return fused <= separate * GELU_MARGIN


def plan_int8(seconds: dict[str, dict[int, float]]) -> Plan:
    """The plan measured times {int8 kernel: {rows: seconds}} give: RULE's (INT8, whose pack every
    int8 layer holds, and the int8 GEMV up to gemv.ROWS rows) unless at some row count another int8
    kernel was MARGIN times faster (it serves those rows, from a pack of its own)."""
    ranges = []
    for most, r in _row_ranges(seconds):
        rule = _rule(seconds, INT8, r)
        fastest = min(seconds, key=lambda name: seconds[name][r])
        ranges.append((most, fastest if seconds[fastest][r] * machine.MARGIN < seconds[rule][r] else rule))
    return Plan(INT8, tuple(ranges), seconds)


def time_kernels(weights: list[tuple[torch.Tensor, torch.Tensor | None]], kernels: list[str], rows,
                 repeats: int = 3, budget: float = TIME_BUDGET) -> dict[str, dict[int, float]]:
    """Best seconds of one pass of x @ W.T + b over every (W, b) of `weights`, in order, per kernel
    and row count, over `repeats` timed passes of each row count in turn (fewer once `budget`
    seconds have gone, at least one): the passes of many rows, the longest by far (an output head
    at 256 rows: 0.3 s), never take the repeats of the few rows a decode step runs. The kernels
    take turns within each repeat, so that a burst of other load on a shared machine hits them
    alike. On a GPU only PLAIN runs, timed to the device's completion."""
    device = weights[0][0].device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    packs = {name: [KERNELS[name].pack_of(w, b) for w, b in weights] for name in kernels}
    # Two kernels in a row that read the weights as they are (no pack): the second would find the
    # end of the first's pass still in the last-level cache, which favours it where a thread starts
    # mid-weight (the output head, one matrix). Before it, a read of other memory that size.
    reads_weights = [KERNELS[name].pack is None for name in kernels]
    after_same = [reads_weights[k] and reads_weights[k - 1] for k in range(len(kernels))]
    evict = _evictor(device) if any(after_same) else None
    inputs = {r: {w.shape[1]: torch.randn(r, w.shape[1], dtype=w.dtype, device=device) for w, _ in weights}
              for r in rows}
    best = {name: {r: math.inf for r in rows} for name in kernels}
    started = time.perf_counter()
    with torch.no_grad():
        for i, r in enumerate(rows):
            xs = inputs[r]
            for repeat in range(-1 if i == 0 else 0, repeats):  # -1: a first pass warms up (allocations, thread pool)
                if repeat > 0 and time.perf_counter() - started > budget:
                    break
                for k, name in enumerate(kernels):
                    linear = KERNELS[name].linear
                    if after_same[k]:
                        evict()
                    sync()
                    start = time.perf_counter()
                    for (w, b), packed in zip(weights, packs[name]):
                        linear(xs[w.shape[1]], packed, w, b)
                    sync()
                    if repeat >= 0:
                        best[name][r] = min(best[name][r], time.perf_counter() - start)
    return best


def _evictor(device: torch.device):
    """A call that reads twice the CPU's last-level cache (at most EVICT_BYTES) of other memory, so
    that what a kernel just read is no longer there; a no-op on a GPU."""
    size = min(2 * machine.last_level_cache_bytes(), EVICT_BYTES)
    if device.type != "cpu" or not size:
        return lambda: None
    other = torch.ones(size // 4)
    return lambda: other.sum()


def _sample(layers: list[nn.Module], enough: int = SAMPLE_BYTES) -> list[nn.Module]:
    """The first of `layers` up to `enough` bytes of weights."""
    sample, size = [], 0
    for module in layers:
        sample.append(module)
        weight = module.weight() if isinstance(module, Int8Linear) else module.weight
        size += weight.numel() * weight.element_size()
        if size >= enough:
            break
    return sample


@functools.cache
def sample_bytes() -> int:
    """How many bytes of a model's weights `choose` times: SAMPLE_BYTES, or twice the last-level
    cache where the CPU reports a larger one. A sample that fits the cache is read from it on every
    timed pass, which favours kernels that compute well over those that stream well
    (docs/notes/kernel-plan.md#sample)."""
    return max(SAMPLE_BYTES, 2 * machine.last_level_cache_bytes())


def speedups(layers: list[nn.Linear], dtypes: list[torch.dtype], rows=(1, 8)) -> dict[torch.dtype, dict[int, float]]:
    """How many times faster the fastest kernel for each of `dtypes` (torch.bfloat16, torch.qint8)
    runs a sample of these float32 layers than the fastest float32 kernel: {dtype: {rows: factor}};
    {} when other processes were too busy for the timings to mean anything."""
    weights = [(m.weight.detach(), None if m.bias is None else m.bias.detach()) for m in _sample(layers, sample_bytes())]
    others = machine.OtherProcesses()

    def fastest(weights, dtype):
        seconds = time_kernels(weights, available(dtype), rows, budget=TIME_BUDGET / 2)
        return {r: min(by_rows[r] for by_rows in seconds.values()) for r in rows}

    base = fastest(weights, torch.float32)
    out = {}
    for dtype in dtypes:
        cast = weights if dtype == torch.qint8 else [(w.to(dtype), None if b is None else b.to(dtype)) for w, b in weights]
        out[dtype] = {r: base[r] / s for r, s in fastest(cast, dtype).items()}
    return out if others.quiet() else {}
