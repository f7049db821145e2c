"""A real client installed from npm for the tests (the Codex CLI, Claude Code): into a cache
directory kept between runs (``RUNLOOP_TEST_CACHE``, default ``~/.cache/runloop-tests``), the
test skipped with a reason when npm is missing or the install fails."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def npm_bin(package: str, version: str, command: str) -> str:
    """The path of ``command`` from ``package@version``, installed once."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("no npm/node: apt-get install nodejs npm")
    cache = Path(os.environ.get("RUNLOOP_TEST_CACHE", Path.home() / ".cache" / "runloop-tests"))
    prefix = cache / f"{package.rsplit('/', 1)[-1]}-{version}"
    exe = prefix / "node_modules" / ".bin" / command
    if not exe.exists():
        r = subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund",
                            "--prefix", str(prefix), f"{package}@{version}"],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0 or not exe.exists():
            pytest.skip(f"could not install {package}@{version}: {r.stderr[-300:]}")
    return str(exe)
