"""Engine throughput on CPU (or a GPU): nanoserve's continuous-batching engine against transformers'
`generate` and against one-request-at-a-time serving, on one workload, in one run (`make bench`).

    python -m bench.engine_bench [--quick] [--repeats 3] [--concurrency 1,8,32,64] [--device cpu|cuda]
                                 [--systems transformers,engine,serial,...] [--json PATH] [--plot PATH]

Workload: a random-weight GPT-2 small checkpoint (12 layers, 768 wide, 50257 tokens; `--model
gpt-neo-125m` or `opt-125m` for those shapes, `--checkpoint` for any directory), float32 on the
CPU; C requests arrive together, each a 32-token prompt (its own) and 64 new tokens, greedy, with
the model's EOS banned (logit_bias -100) so every request generates all 64.

Systems, each in a subprocess of its own that loads the model once (so its peak memory is its own);
the runs alternate between them, in a rotating order, so that drifts in the machine's load hit
all of them alike:
- `transformers`: `AutoModelForCausalLM.generate` over one static batch of the C prompts (KV cache on,
  `do_sample=False`, EOS banned with `sequence_bias`);
- `engine`: `worker.engine.Engine` with `max_batch=C`, the C jobs submitted at once;
- `serial`: the same engine with `max_batch=1`: one request at a time while the others queue,
  which is what a one-request-at-a-time server does (its C requests run one after another, so from
  C = 16 up it runs once per benchmark, one run already holding C requests, and not above 32);
- `engine-int8`, `engine-compile`: the engine's int8 and torch.compile modes (`engine_mode`).
- `engine-bf16`: the engine on the model in bfloat16, where the CPU multiplies bf16 natively
  (nanogpt/runtime/precision.py), else "not available".
- `engine-bf16-compile`, `engine-int8-compile` (only when named in `--systems`): those two with
  the decode step compiled.

`--device cuda` (or `cuda:N`) puts transformers and the engine on that GPU: bfloat16 runs there,
int8 is "not available" (a CPU mode), the ceilings are F.linear's on the GPU replayed from a CUDA
graph (bench/machine.py: the GPU's time, not the host's launches), and the matmul and copy
columns, which bench/machine.py measures on the host CPU, are left empty.

Per run: aggregate completion tokens/s (C × 64 over the time from submission to the last token),
time to first token (submission to the first generated token, median over the C requests), peak
resident memory of the system's process during the run (VmHWM, reset before each run), achieved
GFLOP/s and weight bytes read per second, as fractions of this machine's limits (bench/machine.py),
and the fraction of the ceiling of the system's precision: the tokens/s of the workload's weight
matmuls alone with the fastest kernel of that precision (prefill rows + one row per request per
step; `machine.workload_ceiling`), measured again before each round of runs at a concurrency
(`round_ceilings`), since the host's speed drifts. The summary takes the median over repeats, and ratios against
transformers within the same run. The CPU's model and flags are in `limits`.
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import re
import signal
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench import EOS, SHAPES, model_shape, prompt_ids, rounds, save_figure

SYSTEMS = ("transformers", "engine", "serial", "engine-int8", "engine-compile", "engine-bf16")
# also known, not run by default: the other precisions with the decode step compiled, and on a GPU
# the engine with every kernel launched from Python (no CUDA graphs), taking each step's tokens in
# before the next (-sync), one decode forward a step (-single), and with the model's modules as
# loaded (-unfused: no fused kernels)
MORE_SYSTEMS = ("engine-bf16-compile", "engine-int8-compile", "engine-no-graphs", "engine-bf16-sync",
                "engine-bf16-single", "engine-bf16-unfused")
# the precision whose ceiling each system is held against
PRECISION = {"transformers": "float32", "engine": "float32", "serial": "float32", "engine-compile": "float32",
             "engine-int8": "int8", "engine-bf16": "bfloat16", "engine-bf16-compile": "bfloat16",
             "engine-int8-compile": "int8", "engine-no-graphs": "float32",
             "engine-bf16-sync": "bfloat16", "engine-bf16-single": "bfloat16", "engine-bf16-unfused": "bfloat16"}
# `serial` runs its requests one after another: once per benchmark from 16 up (one run already
# holds C requests), and not above 32 (64 would take minutes and say nothing new: its tokens/s
# does not depend on the concurrency)
SERIAL_ONCE_FROM, SERIAL_UP_TO = 16, 32
# Targets of issue 3: (system, over, concurrency, ratio at least)
TARGETS = [("engine", "transformers", 32, 1.5), ("engine", "transformers", 8, 2.1),
           ("engine", "transformers", 1, 1.4), ("engine-int8", "transformers", 1, 3.7),
           ("engine", "serial", 32, 10.0),
           # the same float32 targets for the compiled decode step (the engine's CPU mode that pays)
           ("engine-compile", "transformers", 1, 1.4), ("engine-compile", "transformers", 8, 2.1),
           ("engine-compile", "transformers", 32, 1.5)]
# the fraction of its precision's ceiling each precision must reach: (at 1 request, at 8 and 32);
# bench/stack_bench.py holds nanoserve's whole stack to the same
CEILING_TARGETS = {"float32": (0.9, 0.76), "bfloat16": (0.57, 0.66), "int8": (0.57, 0.66)}
TARGETS += [(system, "ceiling", c, CEILING_TARGETS[PRECISION[system]][c > 1])
            for system in ("engine", "engine-compile", "engine-bf16", "engine-int8", *MORE_SYSTEMS) for c in (1, 8, 32)]


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 32
    new_tokens: int = 64
    eos: int = EOS  # the model's end-of-text id, banned

    def prompts(self, count: int) -> list[list[int]]:
        return [prompt_ids(i, self.prompt_tokens) for i in range(count)]


class NotAvailable(Exception):
    """A system this engine does not offer (e.g. no int8 mode yet)."""


# ---- memory of this process ----------------------------------------------------------------

def reset_peak_rss() -> None:
    """Make VmHWM (peak resident set) start again from the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def release_free_memory() -> None:
    """Hand memory freed by earlier runs back to the OS (glibc keeps it), so that a run's peak is
    its own and not what a larger run before it left behind."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_mb(field: str = "VmHWM") -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) / 1024


# ---- what a model costs per token ----------------------------------------------------------

def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every matmul weight and bias (tied embeddings
    once, as the output projection) and the LayerNorms; an embedding lookup reads one row only."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) or not hasattr(module, "weight"):
            continue
        for tensor in (module.weight, getattr(module, "bias", None)):
            if callable(tensor):  # a dynamically quantized Linear: weight() is its int8 tensor
                tensor = tensor()
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def flops_per_request(config, workload: Workload) -> float:
    """Forward FLOPs of one request: the prompt and N-1 fed-back tokens through the blocks,
    N outputs through the LM head, and attention over each token's context."""
    d, layers = config["n_embd"], config["n_layer"]
    fed = workload.prompt_tokens + workload.new_tokens - 1
    blocks = 2 * 12 * d * d * layers * fed  # c_attn 3d², attn c_proj d², c_fc 4d², mlp c_proj 4d²
    head = 2 * d * config["vocab_size"] * workload.new_tokens
    attention = 4 * d * layers * sum(range(1, fed + 1))  # QKᵀ and AV over t positions at position t
    return blocks + head + attention


# ---- the systems (each lives in its own subprocess) ------------------------------------------

def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so that a time taken next includes it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFGenerate:
    """transformers' generate over one static batch."""

    def __init__(self, checkpoint: Path, workload: Workload, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.workload, self.device = workload, torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(self.device).eval()

    def run(self, count: int, new_tokens: int) -> dict:
        from transformers import LogitsProcessor, LogitsProcessorList

        device = self.device

        class FirstLogits(LogitsProcessor):
            """Notes when the first logits exist: the prefill is done, token 1 is an argmax away."""
            at = None

            def __call__(self, input_ids, scores):
                if FirstLogits.at is None:
                    synchronize(device)
                    FirstLogits.at = time.perf_counter()
                return scores

        ids = torch.tensor(self.workload.prompts(count), device=device)
        synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=new_tokens, do_sample=False, pad_token_id=self.workload.eos,
                                      sequence_bias=[[[self.workload.eos], -100.0]],
                                      logits_processor=LogitsProcessorList([FirstLogits()]))
        synchronize(device)
        seconds = time.perf_counter() - start
        new = out[:, ids.shape[1]:]
        return {"seconds": seconds, "completion_tokens": new.numel(),
                "ttft": [FirstLogits.at - start] * count, "tokens0": new[0].tolist()}

    def weight_bytes(self) -> int:
        return weight_bytes_per_step(self.model)

    def kernels(self) -> str:
        return "transformers' own"


class EngineRun:
    """nanoserve's engine; `max_batch=None` means one slot per request of the run. Each run
    launches an engine as the worker does (Engine.launch): the model is loaded on the first run's
    engine thread, so no other thread of this process holds an OpenMP team."""

    def __init__(self, checkpoint: Path, workload: Workload, *, max_batch: int | None = None,
                 prepare=None, options: dict | None = None, dtype: torch.dtype = torch.float32,
                 device: str = "cpu"):
        from models.tokenizer import load_tokenizer

        self.workload, self.max_batch, self.options = workload, max_batch, options or {}
        self.threaded = True  # the engine's own thread steps it, as in the worker
        self._source = (checkpoint, device, dtype, prepare)
        self.model = None
        self.tokenizer = load_tokenizer(checkpoint)

    def _load(self):
        """The model, loaded (and prepared: the engine packs what is left of Linear layers, as in
        the worker) on the first call, on the calling thread."""
        from nanogpt.checkpoint import load_model

        if self.model is None:
            checkpoint, device, dtype, prepare = self._source
            model = load_model(checkpoint, device=device, dtype=dtype)
            self.model = prepare(model) if prepare is not None else model
        return self.model

    def run(self, count: int, new_tokens: int) -> dict:
        from worker.engine import Engine
        from worker.protocol import CompletionJob

        first: dict[str, float] = {}
        tokens0: list[int] = []

        def sink(events):  # the engine thread, once per step
            now = time.perf_counter()
            for job_id, kind, data in events:
                if kind == "delta":
                    first.setdefault(job_id, now)
                    if job_id == "r0":
                        tokens0.extend(data["token_ids"])
            return ()

        options = dict(max_batch=self.max_batch or count, max_len=self.workload.prompt_tokens + new_tokens,
                       event_sink=sink, **self.options)
        if self.threaded:
            engine = Engine.launch(self._load, self.tokenizer, **options)
        else:
            engine = Engine(self._load(), self.tokenizer, **options)
        jobs = [CompletionJob(id=f"r{i}", model="bench", prompts=[prompt], max_tokens=new_tokens,
                              temperature=0.0, logit_bias={self.workload.eos: -100.0}, seed=0)
                for i, prompt in enumerate(self.workload.prompts(count))]
        try:
            start = time.perf_counter()
            handles = [engine.submit(job) for job in jobs]
            while not self.threaded and not all(handle.done for handle in handles):
                engine.step()  # in this thread: what a profiler of this thread sees
            results = [handle.result() for handle in handles]
            seconds = time.perf_counter() - start
            stats = engine.stats()
        finally:
            engine.stop()
        return {"seconds": seconds, "completion_tokens": sum(r["usage"]["completion_tokens"] for r in results),
                "ttft": [first[job.id] - start for job in jobs], "tokens0": tokens0,
                "step_phase_ms": phase_ms_per_forward(stats["step_phase_seconds"], stats["steps"])}

    def weight_bytes(self) -> int:
        return weight_bytes_per_step(self.model)

    def kernels(self) -> str:
        """What the engine chose as it loaded: its layers' kernels and its KV cache's dtype."""
        from nanogpt.kernels import few_rows, planner
        from nanogpt.runtime.precision import model_cache_dtype

        cache = str(model_cache_dtype(self.model)).removeprefix("torch.")
        layers = planner.describe(self.model) or few_rows.describe(self.model) or "no packed layers"
        return f"{layers}; KV cache {cache}"


def engine_mode(mode: str) -> tuple:
    """(prepare, engine keyword arguments) of the engine's `int8` mode (the model transform
    `nanogpt.kernels.quantize.quantize_int8`) or `compile` mode (the Engine's `compile` option)."""
    if mode == "int8":
        from nanogpt.kernels.quantize import quantize_int8
        return quantize_int8, {}
    if mode == "compile":
        return None, {"compile": True}
    raise NotAvailable(f"the engine has no {mode} mode")


def chosen_precision(requested: str, device: str):
    """What the worker runs for the registry dtype `requested` on `device` (nanogpt.runtime.precision);
    NotAvailable where it refuses (int8 on a GPU)."""
    from nanogpt.kernels.machine import cpu_flags
    from nanogpt.runtime import precision

    try:
        return precision.choose(requested, device, cpu_flags())
    except ValueError as err:
        raise NotAvailable(str(err)) from err


def build_system(name: str, checkpoint: Path, workload: Workload, device: str = "cpu"):
    if name == "transformers":
        return HFGenerate(checkpoint, workload, device)
    if name == "engine":
        return EngineRun(checkpoint, workload, device=device)
    if name == "serial":
        return EngineRun(checkpoint, workload, max_batch=1, device=device)
    if name == "engine-no-graphs":
        return EngineRun(checkpoint, workload, options={"cuda_graphs": False}, device=device)
    if name not in PRECISION:
        raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS + MORE_SYSTEMS)}")
    prepare, options, dtype = None, {}, torch.float32
    if name.endswith("-compile"):
        options = engine_mode("compile")[1]
    if name.endswith("-sync"):  # each step's tokens taken in before the next step (worker/engine.py `overlap`)
        options = {"overlap": False}
    if name.endswith("-single"):  # one decode forward a step (worker/engine.py `decode_steps`)
        options = {"decode_steps": 1}
    if name.endswith("-unfused"):  # a GPU's modules as loaded (worker/engine.py `fused_kernels`)
        options = {"fused_kernels": False}
    if PRECISION[name] == "int8":
        chosen_precision("int8", device)
        prepare = engine_mode("int8")[0]
    if PRECISION[name] == "bfloat16":
        chosen = chosen_precision("bfloat16", device)
        if chosen.dtype != torch.bfloat16:
            raise NotAvailable(chosen.note)
        dtype = torch.bfloat16
    return EngineRun(checkpoint, workload, prepare=prepare, options=options, dtype=dtype, device=device)


def serve_system(conn, name: str, checkpoint: str, workload: dict, warmup: list[tuple[int, int]],
                 threads: int | None, device: str = "cpu") -> None:
    """Subprocess body: build the system, warm it up, then answer run requests until None."""
    if threads:
        torch.set_num_threads(threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        started = time.perf_counter()
        system = build_system(name, Path(checkpoint), Workload(**workload), device)
        for count, new_tokens in warmup:
            system.run(count, new_tokens)
        conn.send({"ready": True, "load_seconds": time.perf_counter() - started, "kernels": system.kernels(),
                   "rss_after_load_mb": rss_mb("VmRSS"), "weight_bytes": system.weight_bytes()})
    except NotAvailable as err:
        conn.send({"ready": False, "reason": str(err)})
        return
    except Exception:
        conn.send({"ready": False, "reason": traceback.format_exc()})
        return
    while (request := conn.recv()) is not None:
        count, new_tokens = request
        try:
            gc.collect()
            release_free_memory()
            reset_peak_rss()
            result = system.run(count, new_tokens)
            result["peak_rss_mb"] = rss_mb("VmHWM")
            conn.send(result)
        except Exception:
            conn.send({"error": traceback.format_exc()})


class SystemProcess:
    """The parent's handle on one system's subprocess."""

    def __init__(self, name: str, checkpoint: Path, workload: Workload, warmup: list[tuple[int, int]],
                 threads: int | None = None, device: str = "cpu"):
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve_system, name=f"bench-{name}", daemon=True,
                                   args=(child, name, str(checkpoint), asdict(workload), warmup, threads, device))
        self.process.start()
        child.close()
        self.info: dict = {}

    def wait_ready(self) -> dict:
        self.info = self.conn.recv()
        return self.info

    def run(self, count: int, new_tokens: int) -> dict:
        self.conn.send((count, new_tokens))
        result = self.conn.recv()
        if "error" in result:
            raise RuntimeError(f"{self.name} failed at concurrency {count}:\n{result['error']}")
        return result

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


# ---- the benchmark ---------------------------------------------------------------------------

def run_benchmark(checkpoint: Path, systems: list[str], concurrency: list[int], repeats: int,
                  workload: Workload, limits: dict | None = None, gate=None, threads: int | None = None,
                  log=print, device: str = "cpu", min_requests: int = 0) -> dict:
    """Start every system on `device`, run them alternately, summarize. Returns a JSON-able dict.
    min_requests: more rounds than `repeats` at a concurrency whose rounds would time fewer requests
    (bench.rounds).
    threads: torch threads of every system and of the limits' measurement (default: torch's, one
    per core).
    gate: a bench.machine.Gate that times each run in a quiet moment of the (shared) machine and
    records how much CPU other processes took meanwhile (default: no waiting)."""
    from bench.machine import Gate, measure, wait_until_quiet, workload_ceiling

    gate = gate or Gate()

    config = model_shape(checkpoint)
    load_before = os.getloadavg()
    # First calls allocate, pack weights and meet every sequence length; a compiled system compiles
    # for each batch size it meets, and on a GPU a batch size's first round is slower than the next
    # (docs/performance.md#gpu), so there every system, and elsewhere a compiled one, runs the whole
    # workload once at every concurrency first.
    # One system loads at a time: an engine times its kernels and its attention as it loads
    # (nanogpt/kernels/planner.py, decode_attention.py) and trusts no timing taken while other
    # processes are busy, so systems loading side by side fell back to the rules (int8 at 32 requests: 1044 against
    # 1431 tok/s loaded alone, docs/notes/kernel-plan.md).
    procs: dict[str, SystemProcess] = {}
    try:
        ready, unavailable = {}, {}
        for name in systems:
            procs[name] = SystemProcess(name, checkpoint, workload,
                                        [(c, workload.new_tokens) for c in sorted(set(concurrency))]
                                        if "compile" in name or device.startswith("cuda")
                                        else [(min(concurrency), workload.new_tokens)],
                                        threads, device)
            info = procs[name].wait_ready()
            (ready if info["ready"] else unavailable)[name] = info
            log(f"{name}: " + (f"ready in {info['load_seconds']:.1f} s ({info['kernels']})" if info["ready"]
                               else f"not available: {info['reason'].strip().splitlines()[-1]}"))
        for name in unavailable:
            procs.pop(name).close()
        if limits is None:  # measured here, while the systems sit idle
            wait_until_quiet(max_wait=gate.wait, below=gate.quiet_below)
            if threads:
                torch.set_num_threads(threads)
            limits = measure(shape=(config["n_layer"], config["n_embd"], config["vocab_size"]),
                             rows=sorted(set(concurrency)), device=device)
        runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in concurrency} for name in ready}
        names = list(ready)
        shape = (config["n_layer"], config["n_embd"], config["vocab_size"])
        for r, c, of_c in rounds(concurrency, repeats, min_requests):
            # timed as the runs are: once other processes (the last run's system winding down) are quiet
            ceilings = gate.measure(lambda: {"ceilings": round_ceilings(
                limits, {PRECISION[name] for name in names}, c, shape, device)})["ceilings"]
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
                if name == "serial" and (c > SERIAL_UP_TO or (c >= SERIAL_ONCE_FROM and r > 0)):
                    continue
                result = gate.measure(lambda: procs[name].run(c, workload.new_tokens))
                if PRECISION[name] in ceilings:
                    result["ceiling_tokens_per_s"] = workload_ceiling(
                        ceilings[PRECISION[name]], c, workload.prompt_tokens, workload.new_tokens)
                runs[name][c].append(result)
                log(f"repeat {r + 1}/{of_c}  C={c:<3} {name:<15} "
                    f"{result['completion_tokens'] / result['seconds']:8.1f} tok/s  "
                    f"ttft {statistics.median(result['ttft']):6.2f} s  "
                    f"rss {result['peak_rss_mb']:6.0f} MB  others {result['foreign_cores']:.2f} cores "
                    f"(waited {result['waited_s']:.0f} s, try {result['attempts']})")
    finally:
        for proc in procs.values():
            proc.close()
    return {
        "device": device,
        "workload": {**asdict(workload), "model": config["model_type"], "n_layer": config["n_layer"],
                     "n_embd": config["n_embd"], "n_head": config["n_head"], "checkpoint": checkpoint.name},
        "limits": limits,
        "code": code_version(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "systems": {name: {k: v for k, v in info.items() if k != "ready"} for name, info in ready.items()},
        "unavailable": {name: info["reason"].strip().splitlines()[-1] for name, info in unavailable.items()},
        "summary": summarize(runs, ready, config, workload, limits, device),
        "runs": {name: {str(c): rs for c, rs in by_c.items()} for name, by_c in runs.items()},
    }


def round_ceilings(limits: dict, precisions: set[str], rows: int, shape, device: str) -> dict:
    """Each precision's ceiling at `rows` rows measured again, just before a round of runs at that
    concurrency, with the kernels the limits found fastest: this host's speed drifts by up to 1.3x
    within minutes (its matmul peak measured 105 and 182 GFLOP/s half an hour apart), so a run is
    held against a ceiling measured beside it rather than at the start of the benchmark."""
    from bench.machine import PREFILL_ROWS, ceiling, fastest_kernels

    out = {}
    for precision in sorted(precisions):
        known = limits.get("ceilings", {}).get(precision)
        if known:
            out[precision] = ceiling(precision, shape, (rows,), PREFILL_ROWS, repeats=3, device=device,
                                     only=fastest_kernels(known, rows))
    return out


def code_version() -> dict:
    """The commit measured, and which files of the engine's code differed from it."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                              text=True).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted": git("status", "--porcelain", "--", "worker", "nanogpt").splitlines()}


def phase_ms_per_forward(seconds: dict[str, float], forwards: float) -> dict[str, float]:
    """An engine's step time by phase (worker/engine.py STEP_PHASES), in ms a forward."""
    return {phase: 1000 * s / forwards if forwards else 0.0 for phase, s in seconds.items()}


def median_phases(records: list[dict]) -> dict[str, float]:
    """Each phase's median over the records that have `step_phase_ms` ({} where none has)."""
    phased = [r["step_phase_ms"] for r in records if r.get("step_phase_ms")]
    return {phase: statistics.median(p[phase] for p in phased) for phase in phased[0]} if phased else {}


def summarize(runs, ready, config, workload: Workload, limits: dict, device: str = "cpu") -> dict:
    """Median over repeats per (system, concurrency), with ratios and fractions of the limits (of
    the matmul and copy limits only on the CPU, the only device bench/machine.py measures them on)."""
    flops = flops_per_request(config, workload)
    summary: dict[str, dict[int, dict]] = {}
    for name, by_c in runs.items():
        summary[name] = {}
        for c, rs in by_c.items():
            if not rs:
                continue
            tok_s = statistics.median(r["completion_tokens"] / r["seconds"] for r in rs)
            row = {"tokens_per_s": tok_s, "runs": len(rs),
                   "ttft_p50_s": statistics.median(statistics.median(r["ttft"]) for r in rs),
                   "ttft_max_s": statistics.median(max(r["ttft"]) for r in rs),
                   # the smallest: a run's peak can include what a larger earlier run left allocated
                   "peak_rss_mb": min(r["peak_rss_mb"] for r in rs),
                   "foreign_cores": statistics.median(r.get("foreign_cores", 0.0) for r in rs),
                   "gflops": tok_s / workload.new_tokens * flops / 1e9}
            if all("step_phase_ms" in r for r in rs):
                row["step_phase_ms"] = median_phases(rs)
            if device == "cpu":
                row["matmul_peak_fraction"] = row["gflops"] / limits["matmul_gflops"]
            if all("ceiling_tokens_per_s" in r for r in rs):  # each run against the ceiling of its round
                row["ceiling_tokens_per_s"] = statistics.median(r["ceiling_tokens_per_s"] for r in rs)
                row["ceiling_fraction"] = statistics.median(
                    r["completion_tokens"] / r["seconds"] / r["ceiling_tokens_per_s"] for r in rs)
            if c == 1:  # one decode step per token: every weight is read once per token
                row["weight_gbps"] = tok_s * ready[name]["weight_bytes"] / 1e9
                if device == "cpu":
                    row["copy_bandwidth_fraction"] = row["weight_gbps"] / limits["copy_gbps"]
            summary[name][c] = row
    for name, by_c in summary.items():
        for c, row in by_c.items():
            for base in ("transformers", "serial"):
                if base != name and c in summary.get(base, {}):
                    row[f"x_{base}"] = row["tokens_per_s"] / summary[base][c]["tokens_per_s"]
    # greedy tokens of request 0 at concurrency 1: the float32 systems must agree exactly
    first = {name: by_c[min(by_c)][0]["tokens0"] for name, by_c in runs.items() if any(by_c.values())}
    reference = first.get("transformers")
    agreement = {name: (tokens == reference) for name, tokens in first.items()} if reference else {}
    return {"by_system": summary, "greedy_equals_transformers": agreement,
            "targets": check_targets(summary)}


def check_targets(summary) -> list[dict]:
    out = []
    for system, over, c, wanted in TARGETS:
        row = summary.get(system, {}).get(c)
        ratio = row.get("ceiling_fraction" if over == "ceiling" else f"x_{over}") if row else None
        out.append({"system": system, "over": over, "concurrency": c, "target": wanted, "ratio": ratio,
                    "met": None if ratio is None else ratio >= wanted})
    return out


# ---- output ----------------------------------------------------------------------------------

def markdown(results: dict) -> str:
    """The results as markdown tables (docs/performance.md quotes them)."""
    from bench.machine import ceilings_table

    s, limits = results["summary"], results["limits"]
    all_runs = [r for by_c in results["runs"].values() for rs in by_c.values() for r in rs]
    loads = [r["load_average"] for r in all_runs]
    foreign = [r["foreign_cores"] for r in all_runs]
    lines = ["| C | system | tok/s | % of ceiling | × transformers | × serial | TTFT p50 (s) | TTFT max (s) | "
             "peak RSS (MB) | GFLOP/s | % matmul peak |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    concurrency = sorted({c for by_c in s["by_system"].values() for c in by_c})
    for c in concurrency:
        for name, by_c in s["by_system"].items():
            row = by_c.get(c)
            if row is None:
                continue
            ratio = lambda key: f"{row[key]:.2f}" if key in row else ""  # noqa: E731
            percent = lambda key: f"{100 * row[key]:.0f}%" if key in row else ""  # noqa: E731
            lines.append(f"| {c} | {name} | {row['tokens_per_s']:.1f} | {percent('ceiling_fraction')} | "
                         f"{ratio('x_transformers')} | {ratio('x_serial')} | {row['ttft_p50_s']:.2f} | "
                         f"{row['ttft_max_s']:.2f} | {row['peak_rss_mb']:.0f} | {row['gflops']:.1f} | "
                         f"{percent('matmul_peak_fraction')} |")
    lines += ["", "At one request (one decode step per token, every weight read once per token):", "",
              "| system | tok/s | weights read (GB/s) | % of copy bandwidth |", "| --- | ---: | ---: | ---: |"]
    for name, by_c in s["by_system"].items():
        row = by_c.get(1)
        if row and "weight_gbps" in row:
            copy = f"{100 * row['copy_bandwidth_fraction']:.0f}%" if "copy_bandwidth_fraction" in row else ""
            lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {row['weight_gbps']:.1f} | {copy} |")
    lines += ["", "| target | ratio | met |", "| --- | ---: | --- |"]
    for t in s["targets"]:
        ratio = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}"
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        target = (f"{t['target']} of its ceiling" if t["over"] == "ceiling" else f"{t['target']}× {t['over']}")
        lines.append(f"| {t['system']} ≥ {target} at {t['concurrency']} | {ratio} | {met} |")
    if limits.get("ceilings"):
        lines += ["", "Ceilings: the decode step's weight matmuls alone (tokens/s at C rows) per kernel; "
                  "a system's % of ceiling holds its tokens/s against the workload's matmuls alone "
                  "(prefill chunks + C rows a step) with the fastest kernel of its precision "
                  f"({', '.join(f'{n}: {p}' for n, p in PRECISION.items() if n in s['by_system'])}).",
                  "", ceilings_table(limits)]
    device = results.get("device", "cpu")
    if device != "cpu":
        lines += ["", f"GPU: {limits.get('device', '?')} ({device}), where transformers and the engine ran, in "
                  "float32 except engine-bf16; the ceilings are F.linear's on the GPU, replayed from a CUDA graph "
                  "(bench/machine.py). "
                  "The matmul and copy limits below are the host CPU's (bench/machine.py measures them there "
                  "only), so the GPU rows have no % matmul peak or % of copy bandwidth."]
    lines += ["", f"CPU: {limits.get('cpu', '?')} (flags: {' '.join(limits.get('cpu_flags', []))}). "
              f"Torch threads per system: {limits['torch_threads']} (of {limits['cores']} cores). "
              f"Limits: {limits['matmul_gflops']:.1f} GFLOP/s ({limits['matmul_shape']} matmul), "
              f"{limits['copy_gbps']:.1f} GB/s copy (read + write); "
              f"greedy tokens equal to transformers: {s['greedy_equals_transformers']}; "
              f"other processes took {statistics.median(foreign):.2f} cores (median over runs; "
              f"max {max(foreign):.2f}) during the runs; "
              f"load average {min(loads):.2f}–{max(loads):.2f} at the runs' ends "
              f"(median {statistics.median(loads):.2f}), {results['load_average']['before'][0]:.2f} before, "
              f"{results['load_average']['after'][0]:.2f} after; code {results['code']['commit']}"
              + (f" + uncommitted {results['code']['uncommitted']}." if results['code']['uncommitted'] else ".")]
    if results["unavailable"]:
        lines.append("Not available: " + "; ".join(f"{k}: {v}" for k, v in results["unavailable"].items()))
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, by_c in results["summary"]["by_system"].items():
        cs = sorted(by_c)
        ax.plot(cs, [by_c[c]["tokens_per_s"] for c in cs], marker="o", label=name)
    w = results["workload"]
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({c for by_c in results["summary"]["by_system"].values() for c in by_c}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate completion tokens/s")
    where = "CPU" if results.get("device", "cpu") == "cpu" else results["limits"].get("device", "GPU")
    ax.set_title(f"GPT-2 small shape, {where} float32, {w['prompt_tokens']}-token prompts, "
                 f"{w['new_tokens']} new tokens", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    save_figure(fig, path, dpi=120)


def profile(checkpoint: Path, system: str, count: int, workload: Workload, rows: int = 25,
            device: str = "cpu") -> str:
    """Where one run's time goes: torch.profiler's operators by self CPU time, and the share of
    the wall time spent outside torch operators (Python: scheduling, sampling glue, events)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    runner = build_system(system, checkpoint, workload, device)
    runner.threaded = False
    runner.run(count, 4)  # warm-up
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        result = runner.run(count, workload.new_tokens)
    averages = prof.key_averages()
    # self times of all operators sum to the time spent inside torch
    in_torch = sum(e.self_cpu_time_total for e in averages) / 1e6
    head = (f"{system}, {count} requests: {result['completion_tokens'] / result['seconds']:.1f} tok/s, "
            f"{result['seconds']:.2f} s wall, {in_torch:.2f} s inside torch operators "
            f"({100 * in_torch / result['seconds']:.0f}%)\n")
    return head + averages.table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 repeat, concurrency 1,8,32, 16 new tokens (minutes, not a measurement)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--min-requests", type=int, default=0,
                        help="more repeats at a concurrency whose repeats would time fewer requests than this")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, of these and {', '.join(MORE_SYSTEMS)}")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", default="gpt2-small", choices=[s for s in SHAPES if s != "tiny"],
                        help="the random-weight shape to build and serve")
    parser.add_argument("--checkpoint", default=None, help="a Hugging Face directory instead of --model")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda / cuda:N: transformers and the engine on that GPU (int8 is CPU-only)")
    parser.add_argument("--json", default="bench/.cache/engine_bench.json", help="where the results go")
    parser.add_argument("--plot", default=None, help="write the tokens/s plot here (a .png)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per system (default: one per core); on a machine shared with "
                             "others, fewer threads than cores keep a run from waiting on a busy core")
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="before each run, wait up to this many seconds for other processes to go "
                             "quiet (the machine is shared; 0: never wait)")
    parser.add_argument("--quiet-budget", type=float, default=300.0, help="seconds of such waiting in all")
    parser.add_argument("--max-foreign", type=float, default=None,
                        help="redo a run (up to 3 tries) during which other processes took more cores than "
                             "this (default: the cores the systems leave free, plus 0.1)")
    parser.add_argument("--profile", metavar="SYSTEM:C", default=None,
                        help="instead: profile one system at concurrency C in this process (e.g. engine:8)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.concurrency, args.new_tokens = 1, "1,8,32", 16

    from bench import checkpoint as build_checkpoint
    from bench.machine import Gate

    # SIGTERM unwinds like Ctrl-C, so the systems' subprocesses are stopped too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    ckpt = Path(args.checkpoint) if args.checkpoint else build_checkpoint(args.model)
    workload = Workload(args.prompt_tokens, args.new_tokens, model_shape(ckpt)["eos"])
    if args.profile:
        if args.threads:
            torch.set_num_threads(args.threads)
        system, count = args.profile.split(":")
        print(profile(ckpt, system, int(count), workload, device=args.device))
        return {}
    concurrency = [int(c) for c in args.concurrency.split(",")]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    started = time.perf_counter()
    spare = (os.cpu_count() or 1) - (args.threads or torch.get_num_threads()) + 0.1
    max_foreign = spare if args.max_foreign is None else args.max_foreign
    gate = Gate(args.quiet_wait, args.quiet_budget, max_foreign, quiet_below=max_foreign)
    results = run_benchmark(ckpt, systems, concurrency, args.repeats, workload, gate=gate, threads=args.threads,
                            log=lambda msg: print(msg, file=sys.stderr, flush=True), device=args.device,
                            min_requests=args.min_requests)
    results["wall_seconds"] = time.perf_counter() - started
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, Path(args.plot))
    print(markdown(results))
    print(f"\n(results: {out}; {results['wall_seconds']:.0f} s)")
    return results


if __name__ == "__main__":
    main()
