"""How ``scripts/test`` spreads the suite over pytest-xdist workers (tests/conftest.py):
the tests that share a module- or session-scoped fixture run on one worker, so a
fixture that is a whole torchrun run (a reference run) is made once, not once per
worker. Each test runs a small pytest session on three workers (pytester) whose
conftest is a copy of this suite's."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).resolve().parents[1] / "conftest.py").read_text()
ARGS = ("-p", "no:hypothesispytest", "-p", "no:timeout", "-p", "no:cacheprovider",
        "-p", "no:randomly", "-n", "3", "--dist", "loadgroup")

_MADE = '''
import os
import pytest

def _note(what):
    with open(os.environ["EK_PROBE_LOG"], "a") as f:
        f.write(f"{what} {os.environ['PYTEST_XDIST_WORKER']}\\n")
'''


def _made(log: Path) -> Counter[str]:
    return Counter(line.split()[0] for line in log.read_text().splitlines())


def test_shared_fixtures_are_made_once_and_other_tests_spread(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    log = pytester.path / "made.log"
    monkeypatch.setenv("EK_PROBE_LOG", str(log))
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(**{
        "tests/torchrun/scenarios/conftest": _MADE + '''
@pytest.fixture(scope="session")
def reference():
    _note("reference")
''',
        "tests/torchrun/scenarios/test_one": '''
def test_a(reference): pass
def test_b(reference): pass
''',
        "tests/torchrun/scenarios/test_two": '''
def test_c(reference): pass
def test_d(reference): pass
''',
        "tests/torchrun/test_shared": _MADE + '''
@pytest.fixture(scope="module")
def run():
    _note("module")

def test_e(run): pass
def test_f(run): pass
def test_g(run): pass
def test_h(run): pass
''',
        "tests/unit/test_plain": _MADE + '''
import time

@pytest.mark.parametrize("i", range(6))
def test_i(i):
    time.sleep(0.3)
    _note("plain")
''',
    })
    result = pytester.runpytest_subprocess(*ARGS)
    result.assert_outcomes(passed=14)
    made = _made(log)
    assert made["reference"] == 1 and made["module"] == 1, made
    workers = {line.split()[1] for line in log.read_text().splitlines()
               if line.startswith("plain")}
    assert len(workers) >= 2, workers                 # ungrouped tests still spread


def test_the_suite_runs_without_xdist(pytester: pytest.Pytester) -> None:
    """The scheduler hook is xdist's: a run without the plugin (``-p no:xdist``, or a
    Python without it, as on the GPU machine) must not refuse it as unknown."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_one="def test_a(): pass\n")
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:hypothesispytest",
                                           "-p", "no:timeout", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
