"""The whole-server comparison: nanoserve's stack against a peer server, each run held against the
precision's ceiling. Speed itself is measured by `python -m bench.stack_bench`, never asserted here."""
from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import pytest

from bench import engine_bench, llama_cpp, serving_bench, stack_bench


@pytest.mark.slow
def test_stack_bench_runs_nanoserve_against_a_peer(hf_checkpoint, tmp_path):
    """Against a second nanoserve stack standing in for the peer (llama-server takes 10+ minutes to build)."""
    with tempfile.TemporaryDirectory() as workdir, \
            serving_bench.nanoserve(hf_checkpoint, "tiny", "float32", 3, 40, Path(workdir)) as peer:
        peer_url = peer.url + "/v1"
        logged = []
        results = stack_bench.run_benchmark(["float32"], "tiny", [1, 3], 2, prompt_tokens=8, max_tokens=5,
                                            model_dir=hf_checkpoint, peer=peer_url, log=logged.append)
    pair = results["pairs"]["float32"]
    assert pair["servers"] == ["nanoserve:float32", peer_url]
    for spec in pair["servers"]:
        for c in (1, 3):
            runs = pair["runs"][spec][str(c)]
            assert len(runs) == 2  # one per repeat
            for run in runs:
                # C requests at once, every one answered with exactly max_tokens
                assert run["requests"] == c and run["errors"] == 0 and not run["wrong_length"], run["first_error"]
                assert run["completion_tokens"] == 5 * c
                assert run["ceiling_tokens_per_s"] > 0
            row = pair["summary"][spec][str(c)]
            assert row["runs"] == 2 and row["errors"] == 0 and row["wrong_length"] == 0
            assert row["tokens_per_s"] == pytest.approx(statistics.median(r["tokens_per_s"] for r in runs))
            assert row["ceiling_fraction"] > 0
    ours, peer = (pair["summary"][spec] for spec in pair["servers"])
    assert ours["3"]["x_peer"] == pytest.approx(ours["3"]["tokens_per_s"] / peer["3"]["tokens_per_s"])
    assert "x_peer" not in peer["3"]
    # the targets: a ceiling fraction and the comparison with the peer per concurrency
    targets = {(t["target"], t["concurrency"]): t for t in results["targets"]}
    assert set(targets) == {(kind, c) for kind in ("ceiling fraction", "over the peer") for c in (1, 3)}
    assert targets[("ceiling fraction", 1)]["wanted"] == engine_bench.CEILING_TARGETS["float32"][0]
    assert targets[("ceiling fraction", 3)]["wanted"] == engine_bench.CEILING_TARGETS["float32"][1]
    assert targets[("over the peer", 3)]["met"] == (ours["3"]["x_peer"] > 1)
    assert sum("tok/s" in line for line in logged) == 2 * 2 * 2  # servers x repeats x concurrencies

    table = stack_bench.markdown(results)
    assert sum(line.startswith("| float32 |") for line in table.splitlines()) == 2  # one row per C
    assert results["cpu"] in table and table.count("| over the peer | float32 |") == 2
    stack_bench.plot(results, tmp_path / "stack.png")
    assert (tmp_path / "stack.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(results)  # the results are plain JSON


def test_each_precision_meets_llama_cpps_matched_one():
    assert set(stack_bench.PEERS.values()) == set(llama_cpp.PRECISIONS)
    assert set(stack_bench.PEERS) == set(engine_bench.CEILING_TARGETS)


def test_a_precision_the_machine_lacks_is_refused(monkeypatch, capsys):
    monkeypatch.setattr("bench.machine.precisions", lambda device="cpu": ["float32", "int8"])
    with pytest.raises(SystemExit):
        stack_bench.main(["--precisions", "bfloat16"])
    assert "does not run bfloat16 natively" in capsys.readouterr().err


@pytest.mark.slow
def test_a_peer_that_does_not_start_leaves_the_other_pairs_and_the_results(hf_checkpoint, tmp_path, monkeypatch):
    """A llama-server that exits while loading (as q8_0's did on one CPU) is reported with its log,
    and the benchmark goes on to the next precision and still writes what it measured."""
    crashing = tmp_path / "llama-server"
    crashing.write_text("#!/bin/sh\necho 'loading model: crashed'\nexit 3\n")
    crashing.chmod(0o755)
    monkeypatch.setattr(llama_cpp, "build", lambda: crashing)
    monkeypatch.setattr(llama_cpp, "convert", lambda model_dir, precision: tmp_path / f"model-{precision}.gguf")
    logged = []
    results = stack_bench.run_benchmark(["float32"], "tiny", [1], 1, prompt_tokens=8, max_tokens=5,
                                        model_dir=hf_checkpoint, log=logged.append)
    assert results["pairs"] == {}
    failed = results["failed"]["float32"]
    assert failed["server"] == "llama.cpp:f32" and "exited with code 3" in failed["error"]
    assert "loading model: crashed" in failed["error"]  # the server's own log tail
    assert any(line.startswith("!! llama.cpp:f32 did not start") for line in logged)
    results["targets"] = stack_bench.check_targets(results)
    assert results["targets"] == []
    assert "not measured: llama.cpp:f32 did not start (llama-server exited with code 3" in stack_bench.markdown(results)
    stack_bench.plot(results, tmp_path / "none.png")  # nothing to plot: no figure, no error
    assert not (tmp_path / "none.png").exists()
    json.dumps(results)
