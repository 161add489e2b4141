"""The fast tier picks its tests by what they use, and holds them to staying in process."""

from __future__ import annotations

import pytest

from batch_inference_tests.fixtures import tiers

CONFTEST = '''
import pytest

pytest_plugins = ["batch_inference_tests.fixtures.tiers"]


@pytest.fixture
def defs():  # stands for the heavy fixture of the same name
    return object()
'''

TESTS = '''
import socket
import subprocess
import sys
import time

import pytest


def test_plain():
    assert 1 + 1 == 2


@pytest.mark.slow
def test_marked_slow():
    pass


def test_uses_a_heavy_fixture(defs):
    pass


def test_starts_a_child():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_listens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()


def test_swallows_the_refusal():
    try:
        subprocess.run(["true"])
    except Exception:
        pass


def test_probes_the_platform():  # as dagster's croniter does at import: `file -b` on python
    import platform
    platform.architecture()


def test_burns_cpu():
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
'''


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner=TESTS)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\nmarkers =\n    slow: slow\n    process: process\n    fast: fast\n")
    return pytester


def test_fast_is_what_is_neither_marked_slower_nor_uses_a_heavy_fixture(suite: pytest.Pytester) -> None:
    result = suite.runpytest("-m", "fast", "--collect-only", "-q")
    collected = {line.split("::")[1] for line in result.outlines if "::" in line}
    assert collected == {"test_plain", "test_starts_a_child", "test_listens", "test_swallows_the_refusal", "test_probes_the_platform",
                         "test_burns_cpu"}


def test_a_fast_test_that_goes_out_of_process_fails_even_if_it_catches_the_refusal(suite: pytest.Pytester) -> None:
    result = suite.runpytest()  # what `make test` runs: the rules, no CPU budget
    reports = result.reprec.getreports("pytest_runtest_logreport")
    failed = {r.nodeid.split("::")[1] for r in reports if r.failed}
    assert failed == {"test_starts_a_child", "test_listens", "test_swallows_the_refusal"}
    assert len(reports) == 3 * 8  # setup, call, teardown of each: none skipped
    result.stdout.fnmatch_lines(["*went out of process (subprocess [[]'*python*', '-c', 'pass'[]]): mark it pytest.mark.process*",
                                 "*went out of process (listening socket)*", "*went out of process (subprocess [[]'true'[]])*"])


def test_under_m_fast_a_test_over_the_cpu_budget_fails(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiers, "CPU_BUDGET_S", 0.1)
    result = suite.runpytest("-m", "fast", "-k", "burns or plain")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*a fast test used 0.* s of CPU (budget 0 s): mark it pytest.mark.slow*"])
    assert suite.runpytest("-k", "burns").ret == 0  # without -m fast: no budget
