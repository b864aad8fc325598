"""The suite's skip policy (tests/conftest.py): an unexpected skip fails the run.

Each test runs a small pytest session (pytester) whose conftest is a copy of this
suite's, and checks the exit status and what the summary lists.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).resolve().parents[1] / "conftest.py").read_text()
# the inner sessions need no third-party plugin (hypothesis' takes seconds to import)
ARGS = ("-p", "no:hypothesispytest", "-p", "no:timeout", "-p", "no:cacheprovider")


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("ELASTIC_KIT_ALLOW_SKIPS", raising=False)
    pytester.makeconftest(CONFTEST)
    return pytester


def test_skip_for_a_missing_package_fails_the_run(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_a="""
        import pytest

        def test_ok():
            assert 1 + 1 == 2

        def test_needs_a_package():
            pytest.importorskip("no_such_package_for_elastic_kit")
    """)
    result = suite.runpytest(*ARGS)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines([
        "*skips not on the allow-list*",
        "SKIPPED test_a.py::test_needs_a_package: could not import "
        "'no_such_package_for_elastic_kit'*",
        "1 unexpected skip(s) fail this run*",
    ])


def test_module_level_skip_at_collection_fails_the_run(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_b="""
        import pytest

        psutil = pytest.importorskip("no_such_module_psutil_stand_in")

        def test_never_runs():
            pass
    """)
    result = suite.runpytest(*ARGS)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["SKIPPED test_b.py: could not import*"])


def test_skip_with_an_allowed_reason_passes(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_gpu="""
        import pytest

        pytestmark = pytest.mark.skipif(True, reason="CUDA is not available")

        def test_on_gpu():
            pass

        def test_also_on_gpu():
            pass
    """)
    result = suite.runpytest(*ARGS)
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(skipped=2)
    assert "skips not on the allow-list" not in result.stdout.str()


def test_an_opt_in_stress_run_may_skip_but_a_missing_variable_of_another_kind_may_not(
        suite: pytest.Pytester) -> None:
    suite.makepyfile(test_stress="""
        import pytest

        @pytest.mark.skipif(True, reason="set ELASTIC_KIT_EXIT_STRESS=N to run N groups")
        def test_stress():
            pass

        @pytest.mark.skipif(True, reason="set ELASTIC_KIT_SNAPSHOT_DIR to run")
        def test_needs_a_setting():
            pass
    """)
    result = suite.runpytest(*ARGS)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(skipped=2)
    out = result.stdout.str()
    assert "test_needs_a_setting" in out and "SKIPPED test_stress.py::test_stress" not in out


def test_escape_hatch_lists_but_does_not_fail(suite: pytest.Pytester,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_KIT_ALLOW_SKIPS", "1")
    suite.makepyfile(test_c="""
        import pytest

        def test_skipped():
            pytest.skip("etcd is not installed")
    """)
    result = suite.runpytest(*ARGS)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([
        "SKIPPED test_c.py::test_skipped: etcd is not installed",
        "ELASTIC_KIT_ALLOW_SKIPS=1: not failing the run for these",
    ])


def test_xfail_and_failures_keep_their_own_status(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_d="""
        import pytest

        @pytest.mark.xfail(reason="known")
        def test_expected_to_fail():
            assert False

        def test_fails():
            pytest.skip("not allowed")

        def test_really_fails():
            assert 2 + 2 == 5
    """)
    result = suite.runpytest(*ARGS)
    # a real failure keeps exit status 1; the xfail is not listed as a skip
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1, skipped=1, xfailed=1)
    out = result.stdout.str()
    assert "test_expected_to_fail" not in out.split("skips not on the allow-list")[1]


def test_named_absent_packages_allow_only_their_own_skips(suite: pytest.Pytester,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    suite.makepyfile(test_e="""
        import pytest

        def test_needs_s3fs():
            pytest.importorskip("no_such_s3fs_stand_in")

        def test_needs_a_submodule():
            pytest.importorskip("no_such_moto_stand_in.server")

        def test_needs_the_binary():
            pytest.skip("no_such_etcd_stand_in is not installed (apt-get install etcd-server)")

        def test_needs_another_package():
            pytest.importorskip("no_such_other_package")
    """)
    monkeypatch.setenv("ELASTIC_KIT_ABSENT_PACKAGES",
                       "no_such_s3fs_stand_in, no_such_moto_stand_in,no_such_etcd_stand_in")
    result = suite.runpytest(*ARGS)
    result.assert_outcomes(skipped=4)
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # the unnamed package still fails it
    listed = result.stdout.str().split("skips not on the allow-list")[1]
    assert "test_needs_another_package" in listed
    for allowed in ("test_needs_s3fs", "test_needs_a_submodule", "test_needs_the_binary"):
        assert allowed not in listed
    result.stdout.fnmatch_lines(["1 unexpected skip(s) fail this run*"])
