"""Test-suite policy: a skipped test fails the run unless its reason is allowed.

A test that skips because something is missing from the environment (a package, a
binary, a file) looks like a pass in CI: ``pytest.importorskip("psutil")`` once hid
12 tests that way. So every skip whose reason does not match
:data:`ALLOWED_SKIP_REASONS` is listed at the end of the run and turns a passing run
into a failing one (exit status 1). Expected skips are on the list: the GPU tests
(``tests/gpu``) on a machine without CUDA. A missing package is not: install it (the
``test`` extra pulls in everything the suite needs) or, if a test genuinely needs an
optional dependency, import it plainly so its absence is an error.

Escape hatch for local runs: ``ELASTIC_KIT_ALLOW_SKIPS=1 pytest ...`` still lists the
unexpected skips but keeps the exit status. A machine that cannot install a package
(the GPU machine reaches no package registry) names it instead:
``ELASTIC_KIT_ABSENT_PACKAGES=s3fs,moto,etcd`` allows, on that run, only the skips that
say one of those is missing (``scripts/gpu-check`` sets it to what its Python lacks). ``xfail`` results are not skips and are
not affected.

The suite's in-memory snapshots go to a directory of its own (see
:data:`SNAPSHOT_ENV`), removed when the run ends.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
from typing import Any

import pytest

#: Regular expressions (``re.search``) for skip reasons that are expected somewhere.
ALLOWED_SKIP_REASONS: tuple[str, ...] = (
    r"CUDA is not available",
    r"needs (at least )?\d+ (CUDA devices|GPUs)",
    # opt-in stress runs, too long for every run of the suite (their counts are
    # recorded in benchmarks/results/)
    r"^set ELASTIC_KIT_[A-Z_]+_STRESS=N to run",
)

ALLOW_ENV = "ELASTIC_KIT_ALLOW_SKIPS"
ABSENT_ENV = "ELASTIC_KIT_ABSENT_PACKAGES"

_unexpected: list[tuple[str, str]] = []

#: In-memory snapshots are on by default under torchrun (and under the torchrun
#: environment ``spawn_multi_process`` gives); the suite keeps them in a directory of
#: its own, in shared memory like the real thing, and removes it at the end.
SNAPSHOT_ENV = "ELASTIC_KIT_SNAPSHOT_DIR"
_snapshot_root: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _snapshot_root
    if SNAPSHOT_ENV not in os.environ:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        _snapshot_root = tempfile.mkdtemp(prefix="elastic-kit-tests-", dir=shm)
        os.environ[SNAPSHOT_ENV] = _snapshot_root


#: A fixture that one module's tests (or one directory's) share and that is computed
#: once per xdist worker that runs one of them: some are whole torchrun runs.
_SHARED_FIXTURE = re.compile(r"@pytest\.fixture\([^)]*scope=[\"'](module|session)[\"']")


@functools.cache  # once per module per run
def _shares_a_fixture(root: str, path: str) -> bool:
    """Whether the test module ``path`` (relative to ``root``) defines a module- or
    session-scoped fixture of its own."""
    try:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            return _SHARED_FIXTURE.search(f.read()) is not None
    except OSError:
        return False


def work_unit(root: str, nodeid: str) -> str:
    """The unit ``scripts/test`` hands one pytest-xdist worker whole: the real-torchrun
    scenarios under ``tests/torchrun/scenarios`` (they share session fixtures, among
    them a never-interrupted reference run), the tests of a module that defines a
    module- or session-scoped fixture, each other test alone."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/torchrun/scenarios/"):
        return "tests/torchrun/scenarios"
    return path if _shares_a_fixture(root, path) else nodeid


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent without xdist (-p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    # scripts/test runs the suite on pytest-xdist workers (--dist loadgroup). A fixture
    # of module or session scope is computed once per worker that runs a test using
    # it: the tests that share one go to one worker (see work_unit). xdist's own
    # grouping (xdist_group marks, which it appends to each test's id) has no effect
    # under pytest 9, whose ids it can no longer change; this scheduler decides by the
    # id instead, in the controlling process.
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = str(config.rootpath)
    config.option.loadscopereorder = False  # the units in collection order (see _ORDER)

    class _SharedFixturesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(root, nodeid)

    return _SharedFixturesTogether(config, log)


#: The order the suite runs in: the longest work first (the real-torchrun scenarios,
#: one worker's share on their own, then the other torchrun tests), the many short
#: unit tests last, where they fill the workers' tails.
_ORDER = ("tests/torchrun/scenarios/", "tests/torchrun/", "tests/tooling/",
          "tests/multiprocess/", "tests/unit/")


def _rank(nodeid: str) -> int:
    return next((i for i, p in enumerate(_ORDER) if nodeid.startswith(p)), len(_ORDER))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist (each worker collects alike)
        items.sort(key=lambda item: _rank(item.nodeid))  # stable: modules stay whole


def pytest_unconfigure(config: pytest.Config) -> None:
    if _snapshot_root is not None:
        shutil.rmtree(_snapshot_root, ignore_errors=True)
        os.environ.pop(SNAPSHOT_ENV, None)


def skip_reason(report: Any) -> str:
    """The reason text of a skip report ("Skipped: " prefix removed)."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr)
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


def absent_package_reasons() -> tuple[str, ...]:
    """Skip reasons for the packages named in ``ELASTIC_KIT_ABSENT_PACKAGES``: an
    ``importorskip`` of it (or of its submodule) and "NAME is not installed"."""
    names = [n.strip() for n in os.environ.get(ABSENT_ENV, "").split(",") if n.strip()]
    return tuple(p for n in map(re.escape, names)
                 for p in (rf"^could not import '{n}[.']", rf"^{n} is not installed\b"))


def is_allowed(reason: str) -> bool:
    """True when ``reason`` matches an entry of :data:`ALLOWED_SKIP_REASONS`, or says a
    package named in ``ELASTIC_KIT_ABSENT_PACKAGES`` is missing."""
    return any(re.search(p, reason) for p in (*ALLOWED_SKIP_REASONS, *absent_package_reasons()))


def _record(report: Any) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        if not is_allowed(reason):
            _unexpected.append((report.nodeid or str(getattr(report, "fspath", "")), reason))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    # a module-level skip (importorskip, pytestmark skipif) skips at collection
    _record(report)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if (_unexpected and os.environ.get(ALLOW_ENV) != "1"
            and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not _unexpected:
        return
    allowed = os.environ.get(ALLOW_ENV) == "1"
    terminalreporter.section("skips not on the allow-list (tests/conftest.py)", sep="=",
                             red=not allowed, yellow=allowed, bold=True)
    for nodeid, reason in _unexpected:
        terminalreporter.line(f"SKIPPED {nodeid}: {reason}")
    if allowed:
        terminalreporter.line(f"{ALLOW_ENV}=1: not failing the run for these")
    else:
        terminalreporter.line(
            f"{len(_unexpected)} unexpected skip(s) fail this run: install what is missing, "
            f"or add the reason to ALLOWED_SKIP_REASONS if the skip is expected in CI "
            f"({ALLOW_ENV}=1 to allow them locally)")
