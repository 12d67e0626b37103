"""This machine as the kernels see it: the CPU's feature flags, name and last-level cache, how busy
other processes keep it, and the best time of a call.

A choice made by timing (the kernel plan, the KV cache's dtype) is trusted only while other
processes stayed quiet (`OtherProcesses.quiet`), and departs from its rule only where the other
option was MARGIN times faster (docs/notes/kernel-plan.md, kernel-ops.md#quiet-machine).
"""
from __future__ import annotations

import glob
import os
import platform
import time
from pathlib import Path

import torch

# Timings of one kernel move by up to ~20% between runs: only a larger lead counts.
MARGIN = 1.25
# A 2-thread matmul waits for its second thread at every call while another process holds a core:
# timings taken while others used more than this many cores are not trusted.
QUIET_CORES = 0.3


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (where there is no /proc/cpuinfo:
    the ones PyTorch itself detects)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    detected = {"avx2": "_is_avx2_supported", "avx512f": "_is_avx512_supported",
                "avx512_vnni": "_is_vnni_supported", "avx512_bf16": "_is_avx512_bf16_supported",
                "amx_tile": "_is_amx_tile_supported"}
    return frozenset(flag for flag, probe in detected.items()
                     if getattr(torch.cpu, probe, lambda: False)())


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_identity() -> str:
    """What names this CPU model exactly, for results measured on it that outlive the process
    (vendor, family, model, stepping, name, flags and cache of /proc/cpuinfo's first CPU; its name
    and flags elsewhere), with the cores this process may use."""
    fields = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags", "cache size", "Features", "CPU part")
    seen = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                name, _, value = line.partition(":")
                if name.strip() in fields:
                    seen[name.strip()] = value.strip()
    except OSError:
        seen = {"name": cpu_name(), "flags": " ".join(sorted(cpu_flags()))}
    return "\n".join(f"{k}: {v}" for k, v in sorted(seen.items())) + f"\ncores: {len(os.sched_getaffinity(0))}"


def last_level_cache_bytes() -> int:
    """The largest cache the first CPU reports (sysfs; 0 where it reports none)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = Path(path).read_text().strip()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (OSError, ValueError, IndexError):
            continue
    return max(sizes, default=0)


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (all but idle and iowait); 0 where
    there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except OSError:
        return 0.0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherProcesses:
    """Cores used by other processes than this one since it was made (/proc/stat counts 10 ms
    ticks, so a window of a few hundred ms or more is needed)."""

    def __init__(self):
        self._t, self._busy, self._own = time.monotonic(), busy_cpu_seconds(), time.process_time()

    def cores(self) -> float:
        wall = time.monotonic() - self._t
        foreign = (busy_cpu_seconds() - self._busy) - (time.process_time() - self._own)
        return max(0.0, foreign / wall) if wall > 0 else 0.0

    def quiet(self) -> bool:
        """Whether timings taken since this was made can be trusted (QUIET_CORES)."""
        return self.cores() <= QUIET_CORES


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
