"""Stop sequences on text that arrives in pieces (one piece per token)."""
import random

import pytest

from worker.stops import StopMatcher


def run(stops, pieces):
    """Feed pieces; return (the releases, stopped)."""
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        out.append(m.push(p))
        if m.stopped:
            break
    else:
        out.append(m.flush())
    return out, m.stopped


def expected(stops, text):
    """Cut at the stop occurrence that ends first (the longer one if two end together)."""
    hits = [(i + len(s), i) for s in stops if s for i in range(len(text)) if text.startswith(s, i)]
    return (text[:min(hits)[1]], True) if hits else (text, False)


def test_stop_split_across_tokens_is_cut_and_never_shown():
    out, stopped = run(["\n\n"], ["Hello", " world", "\n", "\nmore"])
    assert stopped
    assert "".join(out) == "Hello world"
    assert out == ["Hello", " world", "", ""]  # the first "\n" was held back, then cut


def test_held_prefix_is_released_when_it_does_not_complete():
    out, stopped = run(["STOP"], ["ab", "ST", "O", "x", "y"])
    assert not stopped
    assert out == ["ab", "", "", "STOx", "y", ""]


def test_flush_releases_held_text_at_the_end():
    m = StopMatcher(["###"])
    assert m.push("a#") == "a"
    assert m.flush() == "#"


def test_earliest_completing_stop_wins():
    assert run(["abcd", "bc"], ["abcd"]) == (["a"], True)
    assert run(["abcd", "bc"], list("abcd")) == (["", "", "a"], True)
    assert run(["world", "o w"], ["hello world"]) == (["hell"], True)


def test_stop_inside_one_piece_drops_the_rest():
    assert run(["."], ["one. two"]) == (["one"], True)


def test_no_stops_pass_through():
    assert run([], ["a", "b"]) == (["a", "b", ""], False)


@pytest.mark.parametrize("seed", range(200))
def test_random_texts_and_splits(seed):
    rng = random.Random(seed)
    alphabet = "ab\n "
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
    pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    out, stopped = run(stops, pieces)
    assert ("".join(out), stopped) == expected(stops, text)


def test_include_stop_keeps_the_stop_sequence_and_names_it():
    m = StopMatcher(["END", "\n\n"], include_stop=True)
    assert m.push("abc E") == "abc "
    assert m.push("ND tail") == "END" and m.stopped and m.matched == "END"
    plain = StopMatcher(["END"])
    assert plain.push("abcEND") == "abc" and plain.matched == "END"
