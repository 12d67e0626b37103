"""A pytest plugin for the GPU check's cuda-tests phase (`-p bench.pytest_live`): each test's
outcome and time on a line of its own as it ends, and a failure's report at once. A phase cut at its
time limit never reaches pytest's summary; with this its log still says which tests failed and why,
and which took the time."""
from __future__ import annotations

TAIL = 4000  # characters of a failure's report


def pytest_runtest_logreport(report) -> None:
    # setup and teardown are named only where they failed or skipped the test
    if report.when != "call" and report.passed:
        return
    where = "" if report.when == "call" else f" in {report.when}"
    print(f"\n[test] {report.nodeid} {report.outcome}{where} ({report.duration:.1f} s)", flush=True)
    if report.failed:
        print(report.longreprtext[-TAIL:], flush=True)
