"""How far bfloat16 and int8 move a trained model from float32 (the reference, exact).

    python -m bench.fidelity [--checkpoint checkpoints/shakespeare-char] [--data data/shakespeare_char]
                             [--precisions bfloat16,int8] [--json PATH]

On the held-out split (val.bin), in windows of the model's context taken at evenly spaced offsets:
- held-out loss (mean cross-entropy of the next token) per precision;
- |change| of the true next token's logprob against float32 (mean, p99);
- KL(float32 || precision) of the next-token distributions, mean nats;
- the share of positions whose argmax is float32's;
- greedy: 32 prompts (16 tokens from the split), 48 tokens each; how many completions equal
  float32's, and where the first different token falls (median over those that differ).

Each precision runs as the worker would run it on this CPU: bfloat16 with the model loaded in
bf16 and this machine's bf16 kernels (nanogpt/kernels/planner.py), int8 with the engine's quantize_int8;
every position through the worker's KV cache (prefill, then decode steps), whose keys and values
are bfloat16 for bfloat16 and int8 where this CPU's attention runs faster so
(precision.cache_dtype: the JSON names it). bfloat16 is measured even on a CPU without native bf16
(emulated: slow, same numerics).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch


def load(checkpoint: str, precision: str):
    from bench.engine_bench import engine_mode
    from nanogpt.checkpoint import load_model
    from nanogpt.kernels.planner import pack_linears

    model = load_model(checkpoint, dtype=torch.bfloat16 if precision == "bfloat16" else torch.float32)
    if precision == "int8":
        prepare, _ = engine_mode("int8")
        return prepare(model)
    pack_linears(model)
    return model


def windows(data: Path, count: int, length: int) -> torch.Tensor:
    """`count` windows of `length` + 1 tokens of the held-out split, at evenly spaced offsets."""
    ids = np.memmap(data / "val.bin", dtype=np.uint16, mode="r")
    starts = np.linspace(0, len(ids) - length - 2, count).astype(np.int64)
    return torch.from_numpy(np.stack([ids[s:s + length + 1].astype(np.int64) for s in starts]))


def served_cache(model, rows: int, positions: int):
    """A KV cache of `rows` slots as the worker makes it for this model on this CPU: its keys and
    values in precision.model_cache_dtype (bfloat16 for bfloat16 and int8 where attention pays)."""
    from nanogpt.runtime.kv_cache import KVCache
    from nanogpt.runtime.precision import model_cache_dtype

    return KVCache(model.config, rows, positions, model.device, model_cache_dtype(model))


@torch.no_grad()
def next_token_logprobs(model, batch: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """(N, T, V) float32 log-probabilities of every position's next token, computed as the worker
    serves them: each window's first half prefilled in one chunk, the rest one decode step at a
    time (forward_decode), over the worker's KV cache."""
    out = []
    for chunk in batch.split(rows):
        tokens = chunk[:, :-1]
        B, T = tokens.shape
        cache, slots, half = served_cache(model, B, T), torch.arange(B), T // 2
        logits = [model.forward_cached(tokens[:, :half], torch.full((B,), half), slots, torch.zeros(B, dtype=torch.long),
                                       cache, all_logits=True)]
        for t in range(half, T):
            logits.append(model.forward_decode(tokens[:, t], slots, torch.full((B,), t), cache, torch.arange(t + 1))[:, None])
        out.append(torch.log_softmax(torch.cat(logits, 1).float(), -1))
    return torch.cat(out)


@torch.no_grad()
def greedy(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """(N, new_tokens) greedy continuations: the prompts prefilled, then one decode step a token,
    over the worker's KV cache."""
    B, P = prompts.shape
    cache, slots = served_cache(model, B, P + new_tokens), torch.arange(B)
    logits = model.forward_cached(prompts, torch.full((B,), P), slots, torch.zeros(B, dtype=torch.long), cache)
    out = []
    for i in range(new_tokens):
        out.append(logits.argmax(-1))
        if i + 1 < new_tokens:
            logits = model.forward_decode(out[-1], slots, torch.full((B,), P + i), cache, torch.arange(P + i + 1))
    return torch.stack(out, 1)


def compare(reference: dict, other: dict) -> dict:
    lp_ref, lp = reference["logprobs"], other["logprobs"]
    targets = reference["targets"]
    true_ref = lp_ref.gather(-1, targets[..., None])[..., 0]
    true = lp.gather(-1, targets[..., None])[..., 0]
    change = (true - true_ref).abs().flatten()
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    same = (other["greedy"] == reference["greedy"]).all(1)
    first_diff = [int((a != b).nonzero()[0]) for a, b in zip(other["greedy"], reference["greedy"]) if (a != b).any()]
    return {"heldout_loss": float(-true.mean()), "logprob_change_mean": float(change.mean()),
            "logprob_change_p99": float(change.quantile(0.99)), "kl_nats": float(kl.mean()),
            "argmax_agreement": float((lp.argmax(-1) == lp_ref.argmax(-1)).float().mean()),
            "greedy_identical": int(same.sum()), "greedy_completions": len(same),
            "greedy_first_difference_median": statistics.median(first_diff) if first_diff else None}


def measure(checkpoint: str, data: Path, precisions: list[str], count: int = 256, prompts: int = 32,
            prompt_tokens: int = 16, new_tokens: int = 48) -> dict:
    from nanogpt.runtime.precision import model_cache_dtype

    results = {}
    for precision in ["float32", *precisions]:
        model = load(checkpoint, precision)
        batch = windows(data, count, model.config.block_size)
        starts = windows(data, prompts, prompt_tokens)[:, :prompt_tokens]
        results[precision] = {"logprobs": next_token_logprobs(model, batch), "targets": batch[:, 1:],
                              "greedy": greedy(model, starts, new_tokens),
                              "kv_cache": str(model_cache_dtype(model)).removeprefix("torch.")}
    reference = results["float32"]
    out = {"checkpoint": str(checkpoint), "positions": int(reference["targets"].numel()),
           "float32": {"heldout_loss": float(-reference["logprobs"].gather(
               -1, reference["targets"][..., None]).mean()), "kv_cache": reference["kv_cache"]}}
    out.update({p: {**compare(reference, results[p]), "kv_cache": results[p]["kv_cache"]} for p in precisions})
    return out


def markdown(result: dict) -> str:
    lines = ["| precision | KV cache | held-out loss | mean \\|Δ logprob\\| (p99) | KL (nats) | same argmax | "
             "greedy identical | first difference (median) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
             f"| float32 | {result['float32']['kv_cache']} | {result['float32']['heldout_loss']:.4f} | | | | | |"]
    for p, r in result.items():
        if isinstance(r, dict) and "kl_nats" in r:
            lines.append(f"| {p} | {r['kv_cache']} | {r['heldout_loss']:.4f} | {r['logprob_change_mean']:.4f} "
                         f"({r['logprob_change_p99']:.3f}) | {r['kl_nats']:.5f} | {100 * r['argmax_agreement']:.1f}% | "
                         f"{r['greedy_identical']} of {r['greedy_completions']} | {r['greedy_first_difference_median']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="checkpoints/shakespeare-char")
    parser.add_argument("--data", default="data/shakespeare_char", help="holds val.bin")
    parser.add_argument("--precisions", default="bfloat16,int8")
    parser.add_argument("--windows", type=int, default=256, help="held-out windows of the model's context")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = measure(args.checkpoint, Path(args.data), args.precisions.split(","), args.windows)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
