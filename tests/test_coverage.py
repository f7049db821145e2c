"""Coverage sees what the suite runs: the tests in any order, and the Python processes they
start (``serve``, ``replay``, ``wrap``, their workers). ``conftest._tracer_put_back`` holds
the first for every test; these hold the second and the helper every line counter uses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .work import lines

MEASURED = "import coverage; print(coverage.Coverage.current() is not None)"


def _measuring() -> bool:
    import coverage

    return coverage.Coverage.current() is not None


def test_a_python_process_a_test_starts_is_measured(tmp_path: object) -> None:
    """Bug class: processes the suite starts run unmeasured (the replay's and serve's tests
    counted nothing). Planted: ``patch = ["subprocess"]`` left out of the coverage config;
    second: the environment of the child cleared of COVERAGE_PROCESS_CONFIG (as a test that
    passes ``env={...}`` without ``**os.environ`` does)."""
    if not _measuring():
        pytest.skip("the suite runs without coverage (--no-cov)")
    out = subprocess.run([sys.executable, "-c", MEASURED], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "True", out.stderr
    assert "COVERAGE_PROCESS_CONFIG" in os.environ


def test_the_line_counter_puts_the_tracer_back() -> None:
    """Bug class: a tracer replaced and not restored. Planted: ``lines`` ending with
    ``sys.settrace(None)``; second: the hardening test's own tracer left set (both fail
    here or in ``_tracer_put_back``)."""
    before = sys.gettrace()

    def work(n: int) -> int:
        total = 0
        for i in range(n):
            total += i
        return total

    (total, counted) = lines(work, 40)
    assert total == sum(range(40)) and counted >= 40
    assert sys.gettrace() is before
