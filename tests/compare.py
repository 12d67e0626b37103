"""Comparing completions run in batches of different shapes: the same tokens, texts and finish
reasons, logprobs within float noise (a row's matmuls may sum in another order when the batch
around it differs)."""
from __future__ import annotations

import pytest


def assert_same_choices(got: list[dict], want: list[dict]) -> None:
    assert [(c["index"], c["text"], c["finish_reason"]) for c in got] == \
           [(c["index"], c["text"], c["finish_reason"]) for c in want]
    for g, w in zip(got, want):
        if w["logprobs"] is None:
            assert g["logprobs"] is None
            continue
        assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
        assert g["logprobs"]["text_offset"] == w["logprobs"]["text_offset"]
        assert g["logprobs"]["token_logprobs"] == pytest.approx(w["logprobs"]["token_logprobs"], abs=1e-4)
        for gt, wt in zip(g["logprobs"]["top_logprobs"], w["logprobs"]["top_logprobs"]):
            assert gt == pytest.approx(wt, abs=1e-4)


def assert_same_completion(got: dict, want: dict) -> None:
    """Two completion objects: as assert_same_choices, and the rest equal (but how much of the prompt
    the prefix cache held, which depends on what ran before)."""
    def rest(completion):
        usage = {k: v for k, v in completion["usage"].items() if k != "prompt_tokens_details"}
        return {**{k: v for k, v in completion.items() if k != "choices"}, "usage": usage}

    assert_same_choices(got["choices"], want["choices"])
    assert rest(got) == rest(want)
