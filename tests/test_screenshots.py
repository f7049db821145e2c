"""``docs/screenshots.py`` retakes the docs' inspector screenshots from ``runloop-proxy demo``
(headless chromium, nothing downloaded): run here into a temporary directory, each shot a
PNG of the page it names (the script waits for each page's heading before it shoots).
Planted: the login left out (red: no page headed "Sessions"), the session page's address
cut at its id (red: a 404 page). Skipped with a reason where chromium or chromedriver is
missing."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "docs" / "screenshots.py"


def test_the_docs_screenshots_are_taken_from_the_demo(tmp_path: Path) -> None:
    if not (shutil.which("chromium") or shutil.which("chromium-browser")) \
            or not shutil.which("chromedriver"):
        pytest.skip("no chromium/chromedriver: apt-get install chromium chromium-driver")
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("inspector-sessions.png", "inspector-session.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR", name
        width, height = struct.unpack(">II", png[16:24])
        assert width == 1480 and height > 600, (name, width, height)
        assert f"wrote {tmp_path / name}" in r.stdout
        assert len(png) > 20_000, name  # a page, not a blank window
