"""The one-call GPU check (bench/gpu_check.py) on the CPU: its phases on the tiny shape, a failing
phase recorded without stopping the others, limits and the budget kept, and what a phase leaves
running ended. The GPU's numbers themselves come from running it on a GPU."""
from __future__ import annotations

import importlib.metadata
import json
import os
import statistics
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_check


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def ends(pid: int, within: float = 5.0) -> bool:
    """Whether `pid` is gone (or a zombie) within `within` seconds: a signal takes effect soon, not at once."""
    deadline = time.monotonic() + within
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(pid)


def test_a_phase_past_its_limit_is_stopped_with_its_children(tmp_path):
    pidfile = tmp_path / "child"
    started = time.monotonic()
    entry = gpu_check.run_command(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], 1.0, tmp_path / "log")
    assert entry["status"] == "timed_out" and time.monotonic() - started < 30
    assert ends(int(pidfile.read_text()))  # the whole group, not only the phase's own process

    entry = gpu_check.run_command([sys.executable, "-c", "print('out'); raise SystemExit(3)"], 30.0, tmp_path / "log")
    assert entry["status"] == "failed" and entry["returncode"] == 3 and gpu_check.tail(tmp_path / "log") == "out\n"


def test_what_a_phase_leaves_running_is_ended(tmp_path):
    """A stack's services run in sessions of their own: a phase stopped before it stopped them
    leaves them behind, found by the check's marker in their environment."""
    token = "test-" + os.urandom(4).hex()
    pidfile = tmp_path / "service"
    detach = ("import subprocess, sys; p = subprocess.Popen(['sleep', '60'], start_new_session=True); "
              f"open({str(pidfile)!r}, 'w').write(str(p.pid))")
    env = {**os.environ, gpu_check.MARKER: token}
    assert gpu_check.run_command([sys.executable, "-c", detach], 30.0, tmp_path / "log", env)["status"] == "ok"
    service = int(pidfile.read_text())
    assert running(service) and gpu_check.leftovers(token) == [service]
    assert gpu_check.leftovers(token, keep_groups={os.getpgid(service)}) == []  # a background phase is kept
    assert gpu_check.end_leftovers(token, grace=0.5) == ["sleep 60"]
    assert ends(service) and gpu_check.leftovers(token) == []



def test_a_cut_test_phase_has_already_said_which_tests_failed_and_why(tmp_path):
    """The cuda-tests phase's pytest reports each test as it ends (bench/pytest_live.py): stopped
    at its limit before pytest's summary, its log still names the failure and its assertion."""
    (tmp_path / "test_cut.py").write_text(
        "import time\n"
        "def test_fine(): pass\n"
        "def test_wrong(): assert 2 + 2 == 5, 'arithmetic is off'\n"
        "def test_long(): time.sleep(60)\n")
    entry = gpu_check.run_command([sys.executable, "-m", "pytest", str(tmp_path / "test_cut.py"), "-q",
                                   "-p", "no:cacheprovider", "-p", "bench.pytest_live"], 10.0, tmp_path / "log",
                                  {**os.environ, "PYTHONPATH": str(Path(gpu_check.__file__).parents[1])})
    log = gpu_check.tail(tmp_path / "log")
    assert entry["status"] == "timed_out" and "short test summary" not in log
    assert "test_cut.py::test_fine passed" in log
    assert "test_cut.py::test_wrong failed" in log and "arithmetic is off" in log
    assert "test_long" not in log  # cut while it ran: not reported as ended
    # what the phase's results take of it: the tests that ended, by outcome, the failed, the slowest
    reported = gpu_check.reported_tests(tmp_path / "log")
    assert reported["ended"] == 2 and reported["by_outcome"] == {"failed": 1, "passed": 1}
    assert [name.split("::")[-1] for name in reported["failed"]] == ["test_wrong"]
    assert {name.split("::")[-1] for name, _ in reported["slowest"]} == {"test_fine", "test_wrong"}

def test_phases_that_do_not_fit_the_budget_are_skipped_and_recorded(tmp_path):
    results = gpu_check.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--budget", "1",
                              "--device", "cpu", "--quick", "--skip-install", "--phases", "stack"])
    # the phases that prepare the one asked for, and it: checkpoints are not built with no time left
    assert {name: e["status"] for name, e in results["phases"].items()} == {
        "install": "skipped", "environment": "skipped", "checkpoints": "skipped", "kernels": "skipped",
        "stack": "skipped"}
    assert "budget spent" in results["phases"]["stack"]["reason"]
    written = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert written["phases"] == results["phases"] and written["code"]["tree_sha256"] == gpu_check.tree_hash()
    assert "| stack | skipped: budget spent" in (tmp_path / "out" / "gpu_check.md").read_text()
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path / "out"), "--phases", "install"])  # not a measuring phase


def test_wheels_are_the_versions_tested_here_and_agree_with_each_other():
    requirements = dict(r.split("==") for r in gpu_check.wheel_requirements() if "==" in r)
    for name in gpu_check.MISSING:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # not installed here: unpinned
            assert name in gpu_check.wheel_requirements()
        else:
            assert requirements[name] == version
    # pydantic pins the pydantic-core it runs with: one version of each, the pinned one
    pin = next(r for r in importlib.metadata.requires("pydantic") if r.startswith("pydantic-core"))
    assert pin.replace(" ", "") == f"pydantic-core=={requirements['pydantic-core']}"
    assert any(r.startswith("openai<3") for r in gpu_check.wheel_requirements())


def test_the_code_version_comes_from_the_wheels_record_without_git(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "git_version", lambda root=gpu_check.REPO: None)
    assert gpu_check.code_version(tmp_path)["source"] == "none"
    record = {"commit": "abc1234", "uncommitted": [" M worker/engine.py"], "tree_sha256": gpu_check.tree_hash()}
    (tmp_path / gpu_check.CODE_RECORD).write_text(json.dumps(record))
    code = gpu_check.code_version(tmp_path)
    assert code["commit"] == "abc1234" and code["source"] == "wheels" and code["same_as_recorded"]
    assert gpu_check.describe_code(code) == "abc1234 + 1 uncommitted files (as recorded by make gpu-wheels)"
    (tmp_path / gpu_check.CODE_RECORD).write_text(json.dumps({**record, "tree_sha256": "0" * 16}))
    assert "changed since" in gpu_check.describe_code(gpu_check.code_version(tmp_path))


def test_the_stack_is_held_against_the_engine_of_its_dtype():
    engine = {"summary": {"by_system": {"engine": {"8": {"tokens_per_s": 100.0}},
                                        "engine-bf16": {"8": {"tokens_per_s": 200.0}, "1": {"tokens_per_s": 10.0}}}}}
    stack = {"dtypes": {"float32": {"tokens_per_s": {"8": 50.0}},
                        "bfloat16": {"tokens_per_s": {"8": 150.0, "64": 300.0}}, "int8": {"tokens_per_s": {"8": 1.0}}}}
    ratios = gpu_check.stack_over_engine({"engine-small": {"result": engine}, "stack": {"result": stack}})
    assert ratios == {"float32": {"8": 0.5}, "bfloat16": {"8": 0.75}}  # only where the engine has the row
    assert gpu_check.stack_over_engine({"stack": {"result": stack}}) == {}
    # the steady state's rounds, held against the same engine rows
    stack["dtypes"]["bfloat16"]["steady"] = {"8": {"tokens_per_s": 180.0}, "1": {"tokens_per_s": 9.0}}
    steady = gpu_check.stack_over_engine({"engine-small": {"result": engine}, "stack": {"result": stack}}, steady=True)
    assert steady == {"bfloat16": {"8": 0.9, "1": 0.9}}


def test_the_targets_are_judged_from_what_the_check_measured():
    """Each GPU target's row reads its phase's results; a phase that measured nothing leaves its row unjudged."""
    small = {"summary": {"by_system": {
        "transformers": {"1": {"tokens_per_s": 100.0}, "64": {"tokens_per_s": 3000.0}},
        "engine-bf16": {"1": {"tokens_per_s": 2500.0, "x_transformers": 25.0},
                        "8": {"tokens_per_s": 16000.0, "x_transformers": 9.0},
                        "64": {"tokens_per_s": 20000.0, "x_transformers": 6.7}},
        "engine": {"1": {"tokens_per_s": 90.0, "x_transformers": 0.9}}}}}
    xl = {"summary": {"by_system": {"engine-bf16": {"1": {"tokens_per_s": 800.0, "weight_gbps": 2500.0}}}}}
    stack = {"dtypes": {"bfloat16": {"over_served": {"bursts": {"1": 0.95, "8": 0.85}},
                                     "streamed": {"concurrency": 8, "tpot_p50_s": 0.00055}}}}
    profiled = {"by_concurrency": {"1": {"step_ms": 2.0, "groups_ms_per_step": {"matmul": 1.5},
                                         "matmul_weight_gbps": 2000.0}}}
    results = {"environment": {"copy_gbps": 4000.0}, "stack_over_engine": {"bfloat16": {"1": 0.9, "8": 0.8}},
               "phases": {"engine-small": {"result": small}, "engine-xl": {"result": xl}, "stack": {"result": stack},
                          "profile-xl": {"result": profiled}}}
    rows = gpu_check.targets(results)
    assert [row["met"] for row in rows] == [True, False, True, False, True, False]
    assert rows[2]["measured"].startswith("62%") and rows[3]["measured"] == "0.95 / 0.85 (0.90 / 0.80)"
    # XL's miss or hit beside its profiled forward: the matmuls' share of it and their own pace
    assert rows[2]["measured"].endswith("; profiled: matmuls 1.50 of 2.00 ms a forward, reading at 50%")
    assert rows[4]["measured"].startswith("1.10x")  # 0.55 ms a token against the engine's 8 / 16000 s
    assert rows[5]["measured"].endswith("behind: engine at 1")
    unmeasured = gpu_check.targets({"phases": {}})
    assert all(row["met"] is None for row in unmeasured)


def test_a_steps_kernels_are_grouped_by_what_they_do():
    # kernel names as torch.profiler recorded them on an H200, and the project's own
    names = {"nvjet_sm90_tst_64x8_64x16_4x1_v_bz_bias_TNT": "matmul",
             "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16>": "matmul",
             "void cutlass::Kernel2<cutlass_75_tensorop_bf16_s1688gemm_bf16_64x64_tn_align1>": "matmul",
             "void cublasLt::splitKreduce_kernel<32, 16, int, float>": "matmul",
             "_few_rows": "matmul", "_one_row": "matmul", "_norm_rows": "matmul", "nanoserve::linear": "matmul",
             "_decode_attention": "attention", "void (anonymous namespace)::softmax_warp_forward<c10::BFloat16>": "attention",
             "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>": "norm",
             "_add_layer_norm": "norm", "Memcpy HtoD (Pinned -> Device)": "copy",
             "void at::native::index_elementwise_kernel<128, 4>": "other",
             "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>": "other"}
    assert {name: gpu_check.kernel_group(name) for name in names} == names


def test_a_profiled_forward_says_where_its_time_and_its_weights_went():
    row = {"step_ms": 4.0, "events_per_step": 300, "busy_ms_per_step": 3.0, "top": [],
           "groups_ms_per_step": {"matmul": 2.0, "attention": 0.5, "norm": 0.25, "copy": 0.0, "other": 0.25},
           "weight_gbps": 775.0, "matmul_weight_gbps": 1550.0}
    profiled = {"dtype": "bfloat16", "event_kind": "CUDA kernels and copies", "steps": 16, "weight_bytes": 3.1e9,
                "shape": {"model_type": "gpt2", "n_layer": 48, "n_embd": 1600}, "by_concurrency": {"1": row}}
    text = "\n".join(gpu_check._profile_lines(profiled, copy_gbps=3100.0))
    assert "## One decode step, gpt2 48 layers x 1600, bfloat16" in text
    assert "matmul 2.000, attention 0.500, norm 0.250, copy 0.000, other 0.250 (busy 3.000 of 4.000)" in text
    assert "3.10 GB of weights read at 775 GB/s over the forward, 25% of a copy's, at 1550 GB/s" in text


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_phase_runs_on_the_cpu_and_a_failing_one_stops_none(tmp_path):
    out = tmp_path / "out"
    results = gpu_check.main(["--out", str(out), "--work", str(tmp_path / "work"), "--device", "cpu", "--quick",
                              "--skip-install", "--pytest-path", "tests/no_such_test.py", "--budget", "1100"])
    phases = results["phases"]
    assert set(phases) == set(gpu_check.PHASES) - {"engine-6b"}  # a call of its own
    assert phases["install"]["status"] == "skipped"
    failed = phases["cuda-tests"]
    assert failed["status"] == "failed" and failed["returncode"] != 0 and "no_such_test" in failed["log_tail"]
    assert {name: e["status"] for name, e in phases.items() if name not in ("install", "cuda-tests")} == {
        name: "ok" for name in gpu_check.PHASES if name not in ("install", "cuda-tests", "engine-6b")}
    assert all(e.get("wall_s", 0) <= e.get("limit_s", 0) + gpu_check.STOP_GRACE + 15 for e in phases.values())

    assert results["environment"]["torch"] and results["environment"]["copy_gbps"] > 0
    # the kernels' choice at load, per dtype (on a CPU none is swapped: they are a GPU's)
    assert {dtype: entry["few_rows"]["chosen"] for dtype, entry in phases["kernels"]["result"].items()} == {
        "float32": {}, "bfloat16": {}}
    small = phases["engine-small"]["result"]["summary"]["by_system"]
    assert set(small) == {"transformers", "engine"} and all(set(by_c) == {"1", "2"} for by_c in small.values())
    assert phases["engine-small"]["result"]["summary"]["greedy_equals_transformers"]["engine"]
    assert set(phases["engine-xl"]["result"]["summary"]["by_system"]["engine"]) == {"1"}

    # the quick plan's stack runs its engine in a process of its own, as a GPU worker does by default
    stack = phases["stack"]["result"]["dtypes"]["float32+process+overlap"]
    assert phases["stack"]["result"]["client_processes"] == gpu_check.QUICK.client_processes
    assert phases["stack"]["result"]["web_workers"] == gpu_check.QUICK.web_workers
    assert stack["web_workers"] == stack["web_processes"] == gpu_check.QUICK.web_workers
    new_tokens = gpu_check.QUICK.new_tokens
    # a round of one request is timed again up to min_requests (2) requests; one of two is enough
    assert {c: len(runs) for c, runs in stack["runs"].items()} == {"1": 2, "2": 1}
    assert [len(runs) for runs in phases["engine-small"]["result"]["runs"]["engine"].values()] == [2, 1]
    for c in ("1", "2"):
        for run in stack["runs"][c]:
            assert run["errors"] == 0 and run["completion_tokens"] == int(c) * new_tokens
        assert results["stack_over_engine"]["float32+process+overlap"][c] == stack["tokens_per_s"][c] / small["engine"][c]["tokens_per_s"]
    # the engine as the worker builds it, alone, the same rounds: what the stack's rounds are held against
    assert {c: len(runs) for c, runs in stack["engine_as_served"].items()} == {"1": 2, "2": 1}
    for c in ("1", "2"):
        served = stack["engine_as_served"][c]
        assert all(r["errors"] == 0 and r["completion_tokens"] == int(c) * new_tokens for r in served)
        assert 0 < served[0]["engine"]["busy_share"] <= 1 and served[0]["engine"]["forwards_per_request"] > 0
        median = statistics.median(r["tokens_per_s"] for r in served)
        assert stack["over_served"]["bursts"][c] == stack["tokens_per_s"][c] / median
        assert stack["over_served"]["steady"][c] == stack["steady"][c]["tokens_per_s"] / median
        # and in the steady state, as the stack's steady round is run: what that round is held against too
        alone_steady = stack["engine_steady"][c]
        assert alone_steady["errors"] == 0 and alone_steady["requests"] == int(c) * gpu_check.QUICK.steady
        assert alone_steady["completion_tokens"] == int(c) * gpu_check.QUICK.steady * new_tokens
        assert stack["over_served"]["steady_over_steady"][c] == (
            stack["steady"][c]["tokens_per_s"] / alone_steady["tokens_per_s"])
        # its steps by what they ran, alone and in the stack: the prompts' steps among them, the
        # kinds' shares of the forwards whole
        for kinds in (alone_steady["engine"]["step_kinds"], stack["steady"][c]["engine_in_stack"]["step_kinds"]):
            assert kinds["prompt"]["forwards_per_step"] == 1 and kinds["prompt"]["ms_per_forward"] > 0, kinds
            assert sum(k["forward_share"] for k in kinds.values()) == pytest.approx(1), kinds
    assert stack["streamed"]["errors"] == 0 and stack["streamed"]["itl_p50_s"] > 0
    # each request's time a token from its first chunk to its last
    streamed = stack["streamed"]  # first chunk to last, within each request's own time
    assert 0 < streamed["tpot_p50_s"] * (new_tokens - 1) <= streamed["latency_p50_s"]
    # then every concurrency's clients sending QUICK.steady requests each, every request answered in full
    steady = gpu_check.QUICK.steady
    for c in ("1", "2"):
        run = stack["steady"][c]
        assert run["errors"] == 0 and run["requests"] == int(c) * steady
        assert run["completion_tokens"] == int(c) * steady * new_tokens
        assert run["engine_in_stack"]["forwards_per_request"] > 0
        assert results["steady_over_engine"]["float32+process+overlap"][c] == run["tokens_per_s"] / small["engine"][c]["tokens_per_s"]
    # where one request's time goes, and what requests cost the worker's CPU
    path = stack["request_path_ms"]
    assert set(path) == {"web", "pickup", "engine", "first_token", "decode", "reply", "rq_after_done", "total",
                         "total_unmonitored", "client_floor"}
    # the split adds up to the request's time, MONITOR's record read from a process of its own
    assert path["web"] + path["pickup"] + path["engine"] + path["reply"] == pytest.approx(path["total"], rel=0.25)
    assert all(ms > 0 for ms in path.values())
    assert path["first_token"] < path["engine"] and path["decode"] < path["engine"]
    burst = stack["burst_path"]  # the same, for requests sent at once (the streamed measure's count)
    assert burst["concurrency"] == stack["streamed"]["concurrency"] and set(burst["ms"]) == set(path) - {"client_floor"}
    assert all(ms > 0 for ms in burst["ms"].values())
    for c in ("1", "2"):
        for cpu in stack["worker_cpu_ms"][c]:
            assert cpu["all"] > 0 and cpu["all"] == pytest.approx(cpu["busiest_thread"] + cpu["rest"], abs=0.02)
            # the engine's process counted with the worker's: both worked
            assert cpu["worker_process"] > 0 and cpu["engine_processes"] > 0
            assert cpu["all"] == pytest.approx(cpu["worker_process"] + cpu["engine_processes"], abs=0.02)
        for roles in stack["stack_cpu_ms"][c]:  # every role of the stack worked for the round's requests
            assert set(roles) == {"web", "redis", "worker", "clients"} and all(ms > 0 for ms in roles.values()), roles
        for inside in stack["engine_in_stack"][c]:  # the worker's engine: busy part of the round, not all of it
            assert 0 < inside["busy_share"] < 1 and inside["ms_per_forward"] > 0 and inside["busy_ms_per_request"] > 0
            # its forward's ms by phase, from the worker's metrics, as the engine alone's (its summary row)
            assert sum(inside["step_phase_ms"].values()) == pytest.approx(inside["ms_per_forward"], rel=1e-3)
            alone = phases["engine-small"]["result"]["summary"]["by_system"]["engine"][c]["step_phase_ms"]
            assert set(alone) == set(inside["step_phase_ms"]) and alone["forward"] > 0
    # the worker's own account of the engine it built, from its log: on the CPU no CUDA graphs, its
    # slots those the stack phase asked of it, and its steps a GPU worker's (+overlap)
    ready = stack["worker_log"]["engine_ready"]
    assert ready["cuda_graphs"] == 0 and ready["draw_graphs"] == 0 and ready["max_batch"] == 2, ready
    assert ready["overlap"] is True and ready["decode_steps"] == 4, ready
    assert ready["device"] == "cpu" and ready["dtype"] == "float32" and isinstance(stack["worker_log"]["warnings"], list)
    pickup = phases["stack"]["result"]["pickup_ms"]  # this host's consumer taking a burst of jobs
    assert 0 < pickup["first_in_engine_ms"] <= pickup["last_in_engine_ms"] < pickup["all_finished_ms"]

    step = phases["profile"]["result"]["by_concurrency"]["2"]
    assert step["events_per_step"] > 0 and 0 < step["busy_ms_per_step"] and step["step_ms"] > 0 and step["top"]
    # one request arriving among those running: its prompt's step profiled until its first token
    arrival = step["arrival_profile"]
    assert arrival["kinds"]["prompt"]["steps"] >= 1 and arrival["steps"] == sum(
        k["steps"] for k in arrival["kinds"].values()), arrival  # on a CPU its prompt may be fed in chunks
    assert arrival["events_per_step"] > 0 and arrival["busy_ms_per_step"] > 0 and arrival["host_top"]
    # GPT-2 XL's shape profiled at 1 request (the quick plan's tiny one): its forward's time by kind of
    # kernel, every operator in one of them, and the pace its weights were read at over the forward
    xl = phases["profile-xl"]["result"]
    one = xl["by_concurrency"]["1"]
    assert set(one["groups_ms_per_step"]) == {"matmul", "attention", "norm", "copy", "other"}
    assert sum(one["groups_ms_per_step"].values()) >= one["busy_ms_per_step"] * 0.99 > 0
    assert one["weight_gbps"] == pytest.approx(xl["weight_bytes"] / one["step_ms"] / 1e6)
    assert xl["shape"]["n_layer"] > 0 and xl["weight_bytes"] > 0

    assert json.loads((out / "gpu_check.json").read_text())["phases"].keys() == phases.keys()
    summary = (out / "gpu_check.md").read_text()
    assert "| cuda-tests | failed |" in summary and "## Failures" in summary and "no_such_test" in summary
    assert "## Whole stack" in summary and "## One decode step" in summary
    assert "## Targets" in summary and "| every engine row ahead of transformers at every concurrency |" in summary
    assert "One request arriving among the 2 (profiled" in summary
    assert summary.count("## One decode step, gpt2") == 2 and "A forward at 1 by kind of kernel, ms: matmul" in summary
    assert "first token at 1 (ms)" in summary
    assert "float32+process+overlap, the worker's engine as it said it built it: compiled" in summary
    assert "of that the worker's own process / its engine's process" in summary
    assert "the stack's CPU a request by role" in summary
    # the same dtype with the engine on a thread of the worker and one web process: held against the
    # first variant's engine as served (not measured again), its CPU all in the worker's process
    thread = phases["stack"]["result"]["dtypes"]["float32+thread+web1"]
    assert thread["engine_as_served"] == stack["engine_as_served"] and thread["engine_steady"] == stack["engine_steady"]
    assert thread["web_workers"] == thread["web_processes"] == 1
    assert all(run["errors"] == 0 for runs in thread["runs"].values() for run in runs)
    assert all("engine_processes" not in cpu for cpus in thread["worker_cpu_ms"].values() for cpu in cpus)
    assert "float32+thread+web1, the worker's engine as it said it built it" in summary
    assert "one request alone, ms" in summary and "the worker's CPU a request" in summary
    assert f"the steady state (C clients, {steady} requests each" in summary and "(TPOT) p50" in summary
    assert "the engine as the worker builds it (2 slots" in summary
    assert "the engine as the worker builds it, alone, in the steady state" in summary
    assert "what the engine's steps ran in the steady state" in summary
    assert "the worker's engine in the stack" in summary and "where a forward's ms went by phase" in summary
    assert "A burst of 2 jobs taken by this host's consumer" in summary
    log = (out / "gpu_check.log").read_text()
    assert all(f"===== {name}: " in log for name in gpu_check.PHASES if name not in ("install", "engine-6b"))
    assert not any("processes_left_ended" in e for e in phases.values())  # each phase stopped what it started

    # the plot of its engine and stack rows, as docs/performance.md shows the GPU's
    from PIL import Image

    gpu_check.main(["plot", str(tmp_path / "check.png"), str(out / "gpu_check.json")])
    assert Image.open(tmp_path / "check.png").size[0] > 500


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_6b_phase_runs_when_named_alone(tmp_path):
    """engine-6b (GPT-J-6B's shape; on the CPU the tiny one) is a call of its own: the phases that
    prepare it run, the others do not, its systems as --xl-systems names them, and its weights'
    reads reach the summary."""
    out = tmp_path / "out"
    results = gpu_check.main(["--out", str(out), "--work", str(tmp_path / "work"), "--device", "cpu", "--quick",
                              "--skip-install", "--phases", "engine-6b", "--xl-systems", "transformers,engine",
                              "--budget", "600"])
    phases = results["phases"]
    assert set(phases) == {"install", "environment", "checkpoints", "kernels", "engine-6b"}
    assert {name: e["status"] for name, e in phases.items()} == {
        "install": "skipped", "environment": "ok", "checkpoints": "ok", "kernels": "ok", "engine-6b": "ok"}
    large = phases["engine-6b"]["result"]
    assert large["workload"]["checkpoint"] == f"{gpu_check.QUICK.large}-random"
    assert set(large["summary"]["by_system"]) == {"transformers", "engine"}  # --xl-systems
    assert set(large["summary"]["by_system"]["engine"]) == {"1"}
    assert large["summary"]["by_system"]["engine"]["1"]["weight_gbps"] > 0
    assert "reads its weights at" in (out / "gpu_check.md").read_text()
