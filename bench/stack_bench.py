"""Whole servers head to head: nanoserve's stack against llama.cpp's `llama-server` at matched
precision, on the engine benchmark's workload, each run held against its precision's ceiling.

    python -m bench.stack_bench [--precisions float32,bfloat16,int8] [--concurrency 1,8,32]
                                [--repeats 3] [--model gpt2-small] [--prompt-tokens 32] [--max-tokens 64]
                                [--quiet-wait 0] [--json PATH] [--markdown PATH] [--plot PATH]

Per precision (those this machine runs natively, bench.machine.precisions), nanoserve's whole stack
(`nanoserve:DTYPE`: a private Redis, `processor.py`, gunicorn) and llama-server on the same
checkpoint converted to GGUF at the matched precision (`PEERS`: float32 / f32, bfloat16 / f16,
int8 / q8_0; bench/llama_cpp.py builds it from source) run side by side, each with as many batch
slots as the largest concurrency (bench.serving_bench.server starts both). Then, per repeat and
concurrency C: the precision's ceiling is timed again (engine_bench.round_ceilings: the host's speed
drifts within minutes), and each server in turn (the order alternating) gets C requests at once from
C `openai` clients (bench/loadgen.py's closed loop, not streamed), each a prompt of `--prompt-tokens`
random token ids never sent before (so no prompt cache answers), `--max-tokens` new tokens, greedy,
EOS banned. Reported per server and C, medians over the repeats: aggregate completion tokens/s, its
fraction of the ceiling's tokens/s for the same workload (machine.workload_ceiling), nanoserve over
llama.cpp, latency p50; and the issue's targets (engine_bench.CEILING_TARGETS for nanoserve through
its whole stack, and ahead of llama.cpp at every C).
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench import checkpoint, model_shape, output_arguments, save_figure, write_results
from bench.loadgen import completion_body, openai_sender, run

PEERS = {"float32": "f32", "bfloat16": "f16", "int8": "q8_0"}  # llama.cpp's precision matched to each


def run_benchmark(precisions: list[str], model: str, concurrency: list[int], repeats: int, *,
                  prompt_tokens: int = 32, max_tokens: int = 64, model_dir: Path | None = None,
                  peer: str = "llama.cpp:{}", gate=None, log=print) -> dict:
    """Each precision's pair of servers through `repeats` rounds of every concurrency. `peer`: the
    spec of the server nanoserve is held against, `{}` standing for the matched precision
    (bench.serving_bench.server: `llama.cpp:{}`, or any spec it takes)."""
    from bench.engine_bench import code_version, round_ceilings
    from bench.machine import Gate, ceiling, cpu_flags, workload_ceiling
    from bench.serving_bench import server
    from nanogpt.kernels.machine import cpu_name

    gate = gate or Gate()
    model_dir = model_dir or checkpoint(model)
    config = model_shape(model_dir)
    shape = (config["n_layer"], config["n_embd"], config["vocab_size"])
    results = {"model": model, "workload": {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens},
               "concurrency": concurrency, "repeats": repeats, "cpu": cpu_name(), "cpu_flags": cpu_flags(),
               "cores": os.cpu_count(), "code": code_version(), "load_average_before": os.getloadavg(),
               "pairs": {}, "failed": {}}
    prompts = itertools.count(1_000_000)  # every request a prompt of its own
    for precision in precisions:
        specs = [f"nanoserve:{precision}", peer.format(PEERS[precision])]
        log(f"== {' against '.join(specs)}")
        with ExitStack() as stack:
            sends = {}
            try:
                for spec in specs:
                    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="nanoserve-stack-bench-")))
                    url = stack.enter_context(server(spec, model, max(concurrency), prompt_tokens + max_tokens,
                                                     workdir, model_dir))
                    sends[spec] = openai_sender(url, model)
            except RuntimeError as err:  # a server that did not start (e.g. crashed loading): the next pair
                log(f"!! {spec} did not start: {err}")
                results["failed"][precision] = {"servers": specs, "server": spec, "error": str(err)}
                continue
            for send in sends.values():  # first requests: allocations, shapes, thread pools
                for c in sorted(set(concurrency)):
                    run(send, [completion_body(next(prompts), prompt_tokens, 4) for _ in range(c)], c)
            # which kernels are fastest, timed once; each round times those again
            first = ceiling(precision, shape, rows=tuple(sorted(set(concurrency))))
            runs = {spec: {c: [] for c in concurrency} for spec in specs}
            for r in range(repeats):
                for c in concurrency:
                    timed = gate.measure(lambda: {"ceiling": round_ceilings(  # in a quiet moment, as the runs
                        {"ceilings": {precision: first}}, {precision}, c, shape, "cpu")[precision]})["ceiling"]
                    ceiling_tok_s = workload_ceiling(timed, c, prompt_tokens, max_tokens)
                    for spec in (specs if r % 2 == 0 else specs[::-1]):
                        bodies = [completion_body(next(prompts), prompt_tokens, max_tokens) for _ in range(c)]
                        report = gate.measure(lambda: run(sends[spec], bodies, c))
                        report.update(ceiling_tokens_per_s=ceiling_tok_s,
                                      wrong_length=report["completion_tokens"] != (c - report["errors"]) * max_tokens)
                        runs[spec][c].append(report)
                        log(f"repeat {r + 1}/{repeats} C={c:<3} {spec:<20} {report['tokens_per_s']:8.1f} tok/s "
                            f"({report['tokens_per_s'] / ceiling_tok_s:.2f} of ceiling {ceiling_tok_s:.1f}), "
                            f"errors {report['errors']}, others {report['foreign_cores']:.2f} cores")
        results["pairs"][precision] = {"servers": specs, "first_ceiling": first,
                                       "runs": {spec: {str(c): rs for c, rs in by_c.items()} for spec, by_c in runs.items()},
                                       "summary": summarize(runs, specs)}
    results["load_average_after"] = os.getloadavg()
    results["targets"] = check_targets(results)
    return results


def summarize(runs: dict[str, dict[int, list[dict]]], specs: list[str]) -> dict:
    """Per server and concurrency: medians over the repeats, and nanoserve over its peer."""
    ours, peer = specs
    summary = {}
    for spec, by_c in runs.items():
        summary[spec] = {}
        for c, rs in by_c.items():
            if not rs:
                continue
            summary[spec][str(c)] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "ceiling_fraction": statistics.median(r["tokens_per_s"] / r["ceiling_tokens_per_s"] for r in rs),
                "ceiling_tokens_per_s": statistics.median(r["ceiling_tokens_per_s"] for r in rs),
                "latency_p50_s": statistics.median(r["latency_p50_s"] for r in rs if r["latency_p50_s"] is not None),
                "errors": sum(r["errors"] for r in rs), "wrong_length": sum(bool(r["wrong_length"]) for r in rs),
                "foreign_cores": max(r["foreign_cores"] for r in rs), "runs": len(rs)}
    for c, row in summary[ours].items():
        if c in summary[peer]:
            row["x_peer"] = row["tokens_per_s"] / summary[peer][c]["tokens_per_s"]
    return summary


def check_targets(results: dict) -> list[dict]:
    """The issue's targets for nanoserve through its whole stack: its fraction of the ceiling
    (engine_bench.CEILING_TARGETS) and ahead of its peer (more tokens/s) at every concurrency."""
    from bench.engine_bench import CEILING_TARGETS

    out = []
    for precision, pair in results["pairs"].items():
        ours = pair["summary"][pair["servers"][0]]
        at_one, beyond = CEILING_TARGETS[precision]
        for c, row in ours.items():
            wanted = at_one if int(c) == 1 else beyond
            out.append({"precision": precision, "concurrency": int(c), "target": "ceiling fraction",
                        "wanted": wanted, "measured": row["ceiling_fraction"], "met": row["ceiling_fraction"] >= wanted})
            if "x_peer" in row:
                out.append({"precision": precision, "concurrency": int(c), "target": "over the peer",
                            "wanted": 1.0, "measured": row["x_peer"], "met": row["x_peer"] > 1.0})
    return out


# ---- output ----------------------------------------------------------------------------------

def markdown(results: dict) -> str:
    lines = ["| precision | C | nanoserve tok/s (of ceiling) | peer | peer tok/s (of ceiling) | nanoserve / peer | "
             "ceiling tok/s | latency p50 (s), nanoserve / peer | errors | others' cores |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for precision, pair in results["pairs"].items():
        ours, peer = (pair["summary"][spec] for spec in pair["servers"])
        for c in (str(c) for c in results["concurrency"]):
            a, b = ours.get(c), peer.get(c)
            if not (a and b):
                continue
            lines.append(f"| {precision} | {c} | {a['tokens_per_s']:.1f} ({a['ceiling_fraction']:.0%}) | "
                         f"{pair['servers'][1]} | {b['tokens_per_s']:.1f} ({b['ceiling_fraction']:.0%}) | "
                         f"{a['x_peer']:.2f}× | {a['ceiling_tokens_per_s']:.1f} | "
                         f"{a['latency_p50_s']:.2f} / {b['latency_p50_s']:.2f} | {a['errors'] + b['errors']} | "
                         f"{max(a['foreign_cores'], b['foreign_cores']):.2f} |")
    for precision, failed in results.get("failed", {}).items():
        lines.append(f"| {precision} | – | not measured: {failed['server']} did not start "
                     f"({failed['error'].splitlines()[0]}) | | | | | | | |")
    w = results["workload"]
    lines += ["", f"{results['model']}, {w['prompt_tokens']}-token prompts, {w['max_tokens']} new tokens, greedy, "
              f"EOS banned, C requests at once, medians of {results['repeats']} repeats. CPU: {results['cpu']}, "
              f"{results['cores']} cores (flags: {' '.join(results['cpu_flags'])}); code {results['code']['commit']}.",
              "", "| target | precision | C | wanted | measured | met |", "| --- | --- | ---: | ---: | ---: | --- |"]
    for t in results["targets"]:
        lines.append(f"| {t['target']} | {t['precision']} | {t['concurrency']} | {t['wanted']:.2f} | "
                     f"{t['measured']:.2f} | {'yes' if t['met'] else '**no**'} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = results["pairs"]
    if not pairs:  # no server pair ran
        return
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.6 * len(pairs), 3.6), squeeze=False)
    for ax, (precision, pair) in zip(axes[0], pairs.items()):
        cs = results["concurrency"]
        for spec in pair["servers"]:
            rows = pair["summary"][spec]
            ax.plot(cs, [rows[str(c)]["tokens_per_s"] for c in cs], marker="o", label=spec)
        ours = pair["summary"][pair["servers"][0]]
        ax.plot(cs, [ours[str(c)]["ceiling_tokens_per_s"] for c in cs], linestyle=":", color="grey",
                label=f"{precision} ceiling (matmuls alone)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("completion tokens/s")
        ax.set_title(precision, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    w = results["workload"]
    fig.suptitle(f"{results['model']} through each whole server, {w['prompt_tokens']}-token prompts, "
                 f"{w['max_tokens']} new tokens; {results['cpu']}, {results['cores']} cores", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from bench.machine import Gate, precisions as native

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default=None,
                        help="comma-separated of float32,bfloat16,int8 (default: those this machine runs natively)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="gpt2-small", help="the random-weight checkpoint's shape (bench.SHAPES)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quiet-wait", type=float, default=0.0,
                        help="before each run, wait up to this many seconds for other processes to go quiet")
    output_arguments(parser, "stack_bench")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    available = native("cpu")
    chosen = args.precisions.split(",") if args.precisions else available
    missing = [p for p in chosen if p not in available]
    if missing:
        parser.error(f"this machine does not run {', '.join(missing)} natively (it runs {', '.join(available)})")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    gate = Gate(args.quiet_wait, args.quiet_wait * len(chosen) * len(concurrency) * args.repeats * 3)
    results = run_benchmark(chosen, args.model, concurrency, args.repeats, prompt_tokens=args.prompt_tokens,
                            max_tokens=args.max_tokens, gate=gate, log=log)
    write_results(results, markdown(results), args.json, args.markdown, plot, args.plot)
    return results


if __name__ == "__main__":
    main()
