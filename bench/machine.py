"""This machine's measured limits, the yardsticks for every benchmark here.

    python -m bench.machine [--quick]

- matmul: float32 GFLOP/s of `torch.matmul` at a large square shape (the compute ceiling) and at
  the shapes of GPT-2 small's MLP for a decode batch of B rows (what batched decoding can reach);
- copy: bytes moved per second (read + write) by copying a tensor much larger than the caches
  (decode at one request reads every weight once per token, so this bounds it).

Each figure is the best of several timed repeats: a limit is what the machine can do, and on a
shared machine the best repeat is the one least disturbed by others. `ForeignCpu` and
`wait_until_quiet` tell how much of the machine other processes take, so that the benchmarks can
measure in quiet moments and say how quiet they were.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch


def best_seconds(fn, repeats: int, min_seconds: float = 0.05) -> float:
    """Best time of one call of fn over `repeats` timed batches (each long enough to time)."""
    fn()  # warm up: allocation, thread pool, packing
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
    per_batch = max(1, calls)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(per_batch):
            fn()
        best = min(best, (time.perf_counter() - start) / per_batch)
    return best


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

_TICK = os.sysconf("SC_CLK_TCK")


def busy_cpu_seconds() -> float:
    """CPU seconds spent busy by the whole machine since boot (all but idle and iowait)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICK


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


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "amx_tile")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return [flag for flag in wanted if flag in flags]


def measure(quick: bool = False) -> dict:
    """The limits as a JSON-able dict (GFLOP/s, GB/s); `quick` uses small sizes (a smoke check)."""
    size = 512 if quick else 2048
    decode_rows = (1, 8) if quick else (1, 8, 32, 64)
    repeats = 2 if quick else 5
    return {
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "matmul_shape": f"{size}x{size}x{size}",
        "matmul_gflops": matmul_gflops(size, size, size, repeats),
        # GPT-2 small's c_fc: (B, 768) @ (768, 3072) for a decode batch of B sequences
        "decode_matmul_gflops": {b: matmul_gflops(b, 768, 3072, repeats) for b in decode_rows},
        "copy_gbps": copy_bandwidth((32 if quick else 512) << 20, repeats) / 1e9,
        "load_average": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: seconds, not a measurement")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.quick), indent=2))


if __name__ == "__main__":
    main()
