"""Load test of a running nanoserve stack: throughput, time to first token and latency against
concurrency, written to docs/ as JSON and a plot.

    make serve        # or docker compose up; then, in another terminal:
    python -m bench.loadtest [--base-url http://127.0.0.1:8000/v1] [--model NAME]
                             [--concurrency 1,2,4,8,16,32] [--requests-per-client 3]
                             [--prompt-tokens 32] [--max-tokens 64] [--out docs/loadtest]

The load is bench/loadgen.py's closed loop of real `openai` clients, streaming (so TTFT is seen as a
client sees it): C clients each send `requests-per-client` requests, one after the other, with
prompts of random GPT-2 token ids, greedy, EOS banned. The run is bounded (C × requests per level,
each request with a timeout) and only ever talks to this machine: the base URL must be loopback.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import platform
import socket
import time
import urllib.parse
from pathlib import Path

from bench import save_figure
from bench.loadgen import openai_sender, sweep

REPO = Path(__file__).resolve().parent.parent


def require_loopback(base_url: str) -> None:
    """Refuse any target that is not this machine."""
    host = urllib.parse.urlsplit(base_url).hostname or ""
    addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise SystemExit(f"bench.loadtest only runs against this machine (loopback); {host!r} is not")


def first_model(base_url: str, api_key: str) -> str:
    import openai

    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).models.list().data[0].id


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = result["reports"]
    c = [r["concurrency"] for r in reports]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [("aggregate completion tokens/s", [("tokens/s", "tokens_per_s")]),
              ("time to first token (s)", [("p50", "ttft_p50_s"), ("p99", "ttft_p99_s")]),
              ("request latency (s)", [("p50", "latency_p50_s"), ("p99", "latency_p99_s")])]
    for ax, (title, series) in zip(axes, panels):
        for label, key in series:
            ax.plot(c, [r[key] for r in reports], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel("concurrent clients")
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if len(series) > 1:
            ax.legend()
    fig.suptitle(f"nanoserve load test: {result['model']}, {result['prompt_tokens']}-token prompts, "
                 f"{result['max_tokens']} new tokens, streaming ({result['machine']})")
    save_figure(fig, path)


def markdown(result: dict) -> str:
    lines = ["| clients | tokens/s | requests/s | TTFT p50 | TTFT p99 | latency p50 | latency p99 | errors |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["reports"]:
        lines.append(f"| {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} "
                     f"| {r['ttft_p50_s']:.3f} s | {r['ttft_p99_s']:.3f} s | {r['latency_p50_s']:.3f} s "
                     f"| {r['latency_p99_s']:.3f} s | {r['errors']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY", "unused"))
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    parser.add_argument("--out", default=str(REPO / "docs" / "loadtest"),
                        help="writes OUT.json and OUT.png")
    args = parser.parse_args(argv)

    require_loopback(args.base_url)
    model = args.model or first_model(args.base_url, args.api_key)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    send = openai_sender(args.base_url, model, api_key=args.api_key, stream=True, timeout=args.timeout)
    print(f"load test of {args.base_url}, model {model}: {args.requests_per_client} requests per client, "
          f"{args.prompt_tokens}-token prompts, {args.max_tokens} new tokens, streaming")
    started, load_before = time.time(), os.getloadavg()[0]
    reports = sweep(send, concurrency, args.requests_per_client, args.prompt_tokens, args.max_tokens)
    result = {"base_url": args.base_url, "model": model, "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client,
              "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              # other work on the machine moves the numbers: the 1-minute load average around the run
              "load_average": [load_before, os.getloadavg()[0]], "reports": reports}

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(markdown(result))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
