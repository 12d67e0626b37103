"""This machine's measured limits, the yardsticks for every benchmark here.

    python -m bench.machine [--quick] [--device cpu|cuda]

- ceilings: per precision the machine runs natively (float32; bfloat16 on a CPU with native bf16
  or on CUDA; int8 on a CPU), the time of one decode step's weight matmuls alone (GPT-2 small's
  49: 4 per block and the LM head) at 1 / 8 / 32 / 64 rows, with each kernel PyTorch offers
  (nanogpt/kernels/matmuls.py: F.linear, MKL's packed GEMM, oneDNN's prepacked linear, fbgemm's and
  oneDNN's dynamic int8) and the fastest of them: the ceiling each engine row is held against (bench.engine_bench);
- matmul: float32 GFLOP/s of `torch.matmul` at a large square shape (the compute ceiling) and at
  the shapes of GPT-2 small's MLP for a decode batch of B rows (what batched decoding can reach);
- copy: bytes moved per second (read + write) by copying a tensor much larger than the caches
  (decode at one request reads every weight once per token, so this bounds it);
- the CPU's model name and the flags that decide which kernels are fast.

Each figure is the best of several timed repeats: a limit is what the machine can do, and on a
shared machine the best repeat is the one least disturbed by others. `ForeignCpu` and
`wait_until_quiet` tell how much of the machine other processes take, so that the benchmarks can
measure in quiet moments and say how quiet they were.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from nanogpt.kernels.machine import best_seconds, busy_cpu_seconds


def matmul_gflops(m: int, k: int, n: int, repeats: int = 5) -> float:
    """float32 GFLOP/s of (m, k) @ (k, n)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    seconds = best_seconds(lambda: torch.matmul(a, b, out=out), repeats)
    return 2 * m * k * n / seconds / 1e9


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes per second read plus written by a large tensor copy."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), repeats)
    return 2 * nbytes / seconds


# ---- what else is using the machine (it is shared) ----

def own_cpu_seconds() -> float:
    """CPU seconds used so far by this process and its living descendants (the systems measured)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:  # it exited meanwhile
            pass
    return total


class ForeignCpu:
    """Average number of cores used by other processes than ours between start() and stop()."""

    def start(self) -> "ForeignCpu":
        self._t, self._busy, self._own = time.monotonic(), busy_cpu_seconds(), own_cpu_seconds()
        return self

    def stop(self) -> float:
        wall = time.monotonic() - self._t
        foreign = (busy_cpu_seconds() - self._busy) - (own_cpu_seconds() - self._own)
        return max(0.0, foreign / wall) if wall > 0 else 0.0


def wait_until_quiet(below: float = 0.2, window: float = 1.0, max_wait: float = 300.0) -> float:
    """Wait until other processes than ours use less than `below` cores over `window` seconds
    (at most `max_wait` seconds): on a shared machine, measure in the quiet moments. Returns
    the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < max_wait:
        probe = ForeignCpu().start()
        time.sleep(window)
        if probe.stop() < below:
            break
    return time.monotonic() - started


class Gate:
    """Measure in quiet moments: before a run, wait for other processes to go quiet (use fewer than
    `quiet_below` cores; at most `wait` seconds per run and `budget` seconds in all), and redo a
    run they disturbed anyway (more than `max_foreign` cores on average, up to `attempts` tries;
    the last try stands)."""

    def __init__(self, wait: float = 0.0, budget: float = 0.0, max_foreign: float | None = None,
                 attempts: int = 3, quiet_below: float = 0.2):
        self.wait, self.budget, self.max_foreign, self.attempts = wait, budget, max_foreign, attempts
        self.quiet_below = quiet_below  # "quiet": other processes use fewer cores than this
        self.waited = 0.0

    def measure(self, run) -> dict:
        """run() -> a result dict, which gets `foreign_cores`, `waited_s`, `attempts`, `load_average`."""
        for attempt in range(1, self.attempts + 1):
            allowed = min(self.wait, self.budget - self.waited)
            waited = wait_until_quiet(self.quiet_below, max_wait=allowed) if allowed > 0 else 0.0
            self.waited += waited
            probe = ForeignCpu().start()
            result = run()
            result.update(foreign_cores=probe.stop(), waited_s=waited, attempts=attempt,
                          load_average=os.getloadavg()[0])
            if self.max_foreign is None or result["foreign_cores"] <= self.max_foreign:
                break
        return result


# flags that decide which kernels and precisions are fast (nanogpt/runtime/precision.py)
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
                "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    from nanogpt.kernels.machine import cpu_flags as all_flags

    flags = all_flags()
    return [flag for flag in KERNEL_FLAGS if flag in flags]


# ---- the ceilings: one decode step's weight matmuls alone ------------------------------------

DECODE_ROWS = (1, 8, 32, 64)  # the benchmark's concurrencies
PREFILL_ROWS = 256  # the engine feeds at most this many prompt tokens a step (its prefill chunk)
GPT2_SMALL = (12, 768, 50257)  # n_layer, n_embd, vocab_size


def precisions(device: str = "cpu") -> list[str]:
    """The precisions this machine runs natively: float32 everywhere, bfloat16 on CUDA or a CPU
    with native bf16, int8 on a CPU."""
    from nanogpt.kernels.machine import cpu_flags as all_flags
    from nanogpt.runtime.precision import has_native_bf16

    if device.startswith("cuda"):
        return ["float32", "bfloat16"]
    return ["float32"] + (["bfloat16"] if has_native_bf16(all_flags()) else []) + ["int8"]


def decode_weights(shape=GPT2_SMALL, dtype=torch.float32, device: str = "cpu", seed: int = 0):
    """Random (weight, bias) pairs of a GPT-2's matmuls, in layer order: the blocks' and the LM head's."""
    n_layer, d, vocab = shape
    gen = torch.Generator().manual_seed(seed)
    linear = lambda out, inp, bias=True: (  # noqa: E731
        (torch.randn(out, inp, generator=gen) * 0.02).to(device, dtype),
        (torch.randn(out, generator=gen) * 0.02).to(device, dtype) if bias else None)
    blocks = [linear(out, inp) for _ in range(n_layer) for out, inp in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]
    return blocks, [linear(vocab, d, bias=False)]


def ceiling(precision: str, shape=GPT2_SMALL, rows=DECODE_ROWS, prefill_rows: int | None = PREFILL_ROWS,
            repeats: int = 5, device: str = "cpu", only: list[str] | None = None) -> dict:
    """One precision's ceiling: seconds of the blocks' matmuls and of the LM head's, per kernel and
    rows (the blocks also at `prefill_rows`, a prefill chunk), and per rows PyTorch's fastest: its decode
    step (`step_seconds` = blocks + head) and tokens/s (rows / step). `only`: time these of the
    available kernels alone (the ones known to be fastest)."""
    from nanogpt.kernels import matmuls, planner

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.float32}[precision]
    names = (matmuls.available(torch.qint8) if precision == "int8" else
             [matmuls.PLAIN] if device.startswith("cuda") else matmuls.available(dtype))
    names = [name for name in names if only is None or name in only]
    blocks, head = decode_weights(shape, dtype, device)
    block_rows = sorted({*rows, *([prefill_rows] if prefill_rows else [])})
    time_pass = graphed_pass_seconds if device.startswith("cuda") else \
        lambda weights, rows, repeats: planner.time_kernels(weights, names, rows, repeats, budget=math.inf)
    timings = {"blocks": time_pass(blocks, block_rows, repeats)}
    del blocks
    timings["head"] = time_pass(head, list(rows), repeats)
    # the ceiling is PyTorch's fastest kernel (the definition); the project's own are timed
    # beside it for the record
    pytorch = [name for name in names if name not in matmuls.OWN]
    best = {part: {r: min(by_kernel[k][r] for k in pytorch) for r in (block_rows if part == "blocks" else rows)}
            for part, by_kernel in timings.items()}
    fastest = {r: min(pytorch, key=lambda k: timings["blocks"][k][r] + timings["head"][k][r]) for r in rows}
    step = {r: best["blocks"][r] + best["head"][r] for r in rows}
    return {"kernels": timings, "blocks_seconds": best["blocks"], "head_seconds": best["head"],
            "step_seconds": step, "tokens_per_s": {r: r / s for r, s in step.items()}, "fastest_kernel": fastest}


def graphed_pass_seconds(weights, rows, repeats: int) -> dict[str, dict[int, float]]:
    """On a GPU: {PLAIN: {rows: best seconds}} of one pass of F.linear over `weights`, replayed
    from a CUDA graph and timed by CUDA events, so that the pass costs the GPU's time, not the
    host's launches (the engine replays its decode step from CUDA graphs too)."""
    from nanogpt.kernels.matmuls import PLAIN
    from nanogpt.runtime.cuda_graphs import replay_seconds

    device = weights[0][0].device
    best = {}
    for r in rows:
        xs = {w.shape[1]: torch.randn(r, w.shape[1], dtype=w.dtype, device=device) for w, _ in weights}

        def run():
            for w, b in weights:
                F.linear(xs[w.shape[1]], w, b)

        with torch.cuda.device(device):
            times = replay_seconds(run, repeats + 1)
        best[r] = min(times[1:])  # the first replay warms up
    return {PLAIN: best}


def fastest_kernels(ceiling: dict, rows: int) -> list[str]:
    """The kernels a measured ceiling found fastest for a decode step of `rows` rows and for the
    blocks at a prefill chunk: all a later measurement of that ceiling needs to time."""
    step = {int(r): name for r, name in ceiling["fastest_kernel"].items()}
    blocks = ceiling["kernels"]["blocks"]
    prefill = min(blocks, key=lambda name: _at(blocks[name], PREFILL_ROWS))
    return sorted({step.get(rows) or step[min(step, key=lambda r: abs(r - rows))], prefill})


def workload_ceiling(ceiling: dict, concurrency: int, prompt_tokens: int, new_tokens: int) -> float:
    """Tokens/s of a workload's weight matmuls alone at a precision's ceiling: C prompts prefilled
    in chunks of up to PREFILL_ROWS tokens (the blocks at a chunk's rate, the LM head once per
    prompt), then new_tokens - 1 decode steps of C rows (the first token comes from the prefill)."""
    prompt_rows = concurrency * prompt_tokens
    measured = sorted(int(r) for r in ceiling["blocks_seconds"])
    chunk = max([r for r in measured if r <= min(prompt_rows, PREFILL_ROWS)], default=measured[0])
    prefill = _at(ceiling["blocks_seconds"], chunk) / chunk * prompt_rows + _at(ceiling["head_seconds"], concurrency)
    return concurrency * new_tokens / (prefill + (new_tokens - 1) * _at(ceiling["step_seconds"], concurrency))


def _at(by_rows: dict, rows: int) -> float:
    """A timing keyed by rows (int, or str after JSON) at `rows`; where that count was not
    measured, the time of the next count above (an upper bound), or the largest's scaled up."""
    table = {int(r): s for r, s in by_rows.items()}
    if rows in table:
        return table[rows]
    above = [r for r in table if r > rows]
    near = min(above) if above else max(table)
    return table[near] * (1 if above else rows / near)


def measure(quick: bool = False, device: str = "cpu", shape=GPT2_SMALL, rows=None) -> dict:
    """The limits as a JSON-able dict (GFLOP/s, GB/s, ceilings of a model of `shape`: n_layer,
    n_embd, vocab_size, at `rows` rows, default DECODE_ROWS); `quick` uses small sizes and few
    repeats (a smoke check)."""
    from nanogpt.kernels.machine import cpu_name

    size = 512 if quick else 2048
    decode_rows = tuple(rows or ((1, 8) if quick else DECODE_ROWS))
    repeats = 2 if quick else 5
    return {
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "device": device if device == "cpu" else torch.cuda.get_device_name(device),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "matmul_shape": f"{size}x{size}x{size}",
        "matmul_gflops": matmul_gflops(size, size, size, repeats),
        # GPT-2 small's c_fc: (B, 768) @ (768, 3072) for a decode batch of B sequences
        "decode_matmul_gflops": {b: matmul_gflops(b, 768, 3072, repeats) for b in decode_rows},
        "copy_gbps": copy_bandwidth((32 if quick else 512) << 20, repeats) / 1e9,
        "ceiling_shape": list(shape),
        "ceilings": {p: ceiling(p, shape, decode_rows, PREFILL_ROWS, repeats, device) for p in precisions(device)},
        "load_average": os.getloadavg(),
    }


def ceilings_table(limits: dict) -> str:
    """The ceilings as a markdown table: tokens/s of the decode step's weight matmuls per kernel."""
    lines = ["| precision | kernel | " + " | ".join(f"{r} rows" for r in limits["ceilings"]["float32"]["step_seconds"])
             + " |", "| --- | --- |" + " ---: |" * len(limits["ceilings"]["float32"]["step_seconds"])]
    for precision, c in limits["ceilings"].items():
        for kernel in c["kernels"]["head"]:
            cells = [int(r) / (c["kernels"]["blocks"][kernel][r] + c["kernels"]["head"][kernel][r])
                     for r in c["step_seconds"]]
            lines.append(f"| {precision} | {kernel} | " + " | ".join(f"{t:.1f}" for t in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: seconds, not a measurement")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    limits = measure(args.quick, args.device)
    if args.json:
        Path(args.json).write_text(json.dumps(limits, indent=1))
    print(json.dumps({k: v for k, v in limits.items() if k != "ceilings"}, indent=2))
    print(ceilings_table(limits))


if __name__ == "__main__":
    main()
