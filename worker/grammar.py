"""Structured output on the worker: a request's grammar (llguidance's, which web built from its JSON
schema, regex, choices or Lark grammar: web/api/structured.py) constrains each of its sequences
token by token.

Each constrained sequence has an `llguidance.LLMatcher`. Each step the matchers of the batch's
constrained rows fill one bitmask on the host, which goes to the
logits' device in one copy and bans there every token the grammar does not allow, before any other
logits processor; the drawn token then advances the row's matcher. A sequence whose grammar is
complete (nothing but the end of text may follow) ends with `stop` (output.py); one cut by
max_tokens ends with `length`, its text a prefix of a valid one.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch

from worker.errors import EngineError

_BITS = torch.arange(32, dtype=torch.int32)


class Grammars:
    """llguidance's view of one model's vocabulary (built once, on first use),
    and the matchers made with it: each grammar compiled once (`check`, as the job is submitted),
    each sequence's matcher a copy of that one."""

    TEMPLATES = 64  # the grammars kept compiled (a request's `n` sequences share theirs)

    def __init__(self, tokenizer, vocab_size: int):
        self.source, self.vocab_size = tokenizer, vocab_size
        self._tokenizer = None
        self._templates: OrderedDict[str, object] = OrderedDict()  # grammar -> its matcher at the start
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(self.source)))
            return self._tokenizer

    def matcher(self, grammar: str, history: list[int] = ()):
        """A matcher of `grammar` that has consumed `history` (the tokens a resumed sequence already
        generated). A grammar llguidance refuses (web checked it already) refuses the request."""
        matcher = self._template(grammar).deep_copy()
        for token in history:
            if not matcher.consume_token(token):
                break  # what an earlier attempt wrote stands; the rest is constrained from where it holds
        return matcher

    def _template(self, grammar: str):
        with self._lock:
            template = self._templates.get(grammar)
            if template is not None:
                self._templates.move_to_end(grammar)
                return template
        import llguidance

        template = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if template.is_error():
            raise EngineError(f"Invalid structured output grammar: {template.get_error()}", param="structured_outputs")
        with self._lock:
            self._templates[grammar] = template
            while len(self._templates) > self.TEMPLATES:
                self._templates.popitem(last=False)
        return template

    def check(self, grammar: str) -> None:
        """Refuse a grammar llguidance cannot compile, or one no text of this vocabulary can follow."""
        matcher = self.matcher(grammar)
        stuck = torch.isinf(self.mask(torch.zeros(1, self.vocab_size), [matcher])).all()
        if matcher.is_error() or (stuck and not matcher.is_accepting()):
            raise EngineError("The structured output constraint matches no text this model can write.",
                              param="structured_outputs")

    def mask(self, logits: torch.Tensor, matchers: list) -> torch.Tensor:
        """Ban (-inf, in place) in each row of logits (B, V) the tokens its matcher does not allow now
        (rows whose matcher is None are left as they are)."""
        rows = [b for b, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        import llguidance.torch as llg_torch

        bitmask = llg_torch.allocate_token_bitmask(len(rows), logits.shape[-1])
        for i, b in enumerate(rows):
            llg_torch.fill_next_token_bitmask(matchers[b], bitmask, i)
        banned = _banned(bitmask, logits.shape[-1], logits.device)
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(banned, float("-inf"))
        else:
            index = torch.tensor(rows, device=logits.device)
            logits[index] = logits[index].masked_fill(banned, float("-inf"))
        return logits


def _banned(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """(R, V) bool: the tokens a bitmask (R, ceil(V / 32)) int32 does not allow (bit j of word w
    allows token 32 w + j). Unpacked by numpy on a CPU, where it is much faster than the tensor ops;
    by the tensor ops on another device, where the packed words go in one small copy."""
    if device.type == "cpu":
        return _banned_by_numpy(bitmask, vocab_size)
    return _banned_on(bitmask, vocab_size, device)


def _banned_by_numpy(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits == 0)


def _banned_on(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    allowed = (bitmask.to(device, non_blocking=True)[:, :, None] >> _BITS.to(device)) & 1
    return allowed.view(len(bitmask), -1)[:, :vocab_size] == 0


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads of a tokenizer (models/tokenizer.py): each id's bytes,
    the end-of-text id, the special ids, and an encoder."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.bos_token_id = tokenizer.prompt_bos
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_ids)
        self.eos_token_id = tokenizer.eos_token_id
        if self.eos_token_id is None:
            # A vocabulary without one (nanoGPT's characters): llguidance needs an end token, so it
            # gets one past the model's ids, which the mask cuts off; such a sequence ends when its
            # grammar is complete, or at max_tokens.
            self.eos_token_id = len(self.tokens)
            self.tokens.append(b"<|end|>")
            self.special_token_ids.append(self.eos_token_id)

    def __call__(self, text: str | bytes) -> list[int]:
        return self.tokenizer.encode_ordinary(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)
