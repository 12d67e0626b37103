"""OpenAI's legacy `logprobs` object: the tensor side (log_softmax of the raw logits, before any
temperature, penalty or bias) and the host side (token strings, top-N dicts, text offsets).

A fragment is `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` for a run of tokens;
stream deltas carry fragments, the final choice carries their concatenation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FLOOR = -9999.0  # -inf is not JSON; vLLM clamps the same way


def score(logits: torch.Tensor, tokens: torch.Tensor, k: int, vocab: int | None = None):
    """logits (..., rows) raw, over every row of the model's head, tokens (...) long -> logprob of
    each token (...), and the top k logprobs (..., k) with their ids (..., k), descending, among the
    first `vocab` ids (the tokenizer's: rows past it have no text). Normalized over every row, as
    transformers and vLLM report them."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    lp = lp[..., :vocab]
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[..., :0], tokens.unsqueeze(-1)[..., :0])
    return chosen, top_lp, top_ids


@dataclass
class TokenLogprob:
    """One token's entry: its logprob (None for an echoed prompt's first token), the top-N
    alternatives [(id, logprob)] (None likewise) and where its text starts."""
    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None
    text_offset: int


def _clamp(x: float) -> float:
    return x if x > FLOOR else FLOOR


def fragment(entries: list[TokenLogprob], token_string) -> dict:
    """The OpenAI lists for `entries`; `token_string(id) -> str` names tokens. Each top_logprobs
    dict holds the top-N and, if it is not among them, the chosen token."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(token_string(e.token_id))
        out["token_logprobs"].append(None if e.logprob is None else _clamp(e.logprob))
        if e.top is None:
            out["top_logprobs"].append(None)
        else:
            top = {token_string(i): _clamp(lp) for i, lp in e.top}
            top.setdefault(token_string(e.token_id), _clamp(e.logprob))
            out["top_logprobs"].append(top)
        out["text_offset"].append(e.text_offset)
    return out
