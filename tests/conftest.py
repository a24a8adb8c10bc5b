"""The suite on several pytest-xdist workers (`-n 2 --dist loadgroup`, docs/testing.md).

Each module is one group, run by one worker, so its module-scoped fixtures (a trained run that
several tests read) are built once; tests/slurm is one group, since its modules share one Slurm
cluster. A test marked `exclusive` times the run it starts (a hang timeout, a straggler's ratio), or
runs 4 ranks on the 2 cores, whose collectives crawl beside another worker's runs (the 4-rank
expert-parallel and TP x DP tests: 33-70 s alone, 145-319 s beside others): it runs while no other worker runs
a test; the others hold a shared lock for each of theirs. Each worker gets one thread of math
libraries and its own TMPDIR. Without xdist none of this applies; with or without, a test that
leaves a variable read at import time changed (which would send its worker's later runs to fresh
processes, not the zygote) is an error."""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread of math libraries per worker (set before numpy or torch load them): N workers on N
    # cores, not N x N threads; small problems (a scaling fit's descents) ran 4x slower oversubscribed.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
TMP = Path(tempfile.gettempdir())  # (before pytest_configure gives each worker its own)


def _group(item) -> str:
    path = Path(str(item.fspath)).resolve()
    return "slurm" if TESTS / "slurm" in path.parents else str(path.relative_to(TESTS))


@pytest.hookimpl(tryfirst=True)  # (before xdist names each test's group in its id)
def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):
        # The groups that cost most first (a slow test ~30 s, the others ~0.3 s), so the last ones
        # handed out are short and neither worker waits long for the other at the end (xdist's own
        # order, by count of tests, put one-test modules of minutes last: --no-loadscope-reorder).
        weight: dict[str, float] = {}
        for item in items:
            group = _group(item)
            weight[group] = weight.get(group, 0) + (30 if item.get_closest_marker("slow") else 0.3)
        items.sort(key=lambda item: -weight[_group(item)])  # (stable: each group's tests in their order)
        for item in items:
            item.add_marker(pytest.mark.xdist_group(_group(item)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    workerinput = getattr(item.config, "workerinput", None)
    if workerinput is None:
        yield
        return
    path = TMP / f"pytest-exclusive-{workerinput['testrunuid']}.lock"
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if item.get_closest_marker("exclusive") else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session", autouse=True)
def _import_time_environment():
    """The variables read at import time (tests/zygote.py: `signature`) in the environment this
    process gives its runs, as its first test (before any other fixture) found them."""
    from helpers import train_env
    from zygote import signature

    return signature(train_env())


@pytest.fixture(autouse=True)
def _the_zygote_stays_usable(_import_time_environment):
    """A test, or a fixture it set up, that leaves one of those variables changed in this process
    would make every later run of its worker start fresh, ~10 s of imports each: an error at its end,
    naming the variable. (Found so: sklearn, imported by a test, sets KMP_DUPLICATE_LIB_OK, and most
    of the suite's runs started fresh.)"""
    from helpers import train_env
    from zygote import signature

    yield
    now = signature(train_env())
    was = _import_time_environment
    changed = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
    if changed:
        was.clear()
        was.update(now)  # (one error, not one for each later test)
        pytest.fail(f"the test left {', '.join(changed)} changed in the environment of this worker's later runs")


def pytest_configure(config):
    # Each worker's own temporary directory: the inductor caches (one per rank under it) and other
    # temporary files of the runs two workers start at once are not shared.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        tmp = TMP / f"pytest-{worker}"
        tmp.mkdir(exist_ok=True)
        os.environ["TMPDIR"] = str(tmp)
        tempfile.tempdir = None
