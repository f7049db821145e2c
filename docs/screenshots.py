"""The inspector's screenshots in the docs, taken from ``runloop-proxy demo``.

    python docs/screenshots.py [--out docs]

Starts the demo (its own embedded Redis, in a temporary directory, on a free port, with an
admin key made here), logs in with headless chromium through the system chromedriver (the
test suite's WebDriver client, ``tests/webdriver.py``: nothing is downloaded), and writes
``inspector-sessions.png`` (the landing page: totals and the demo's session) and
``inspector-session.png`` (that session's page: the chart, the window) into ``--out``. Needs
a development checkout (the test extras) and ``chromium`` and ``chromedriver`` installed.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ("inspector-sessions.png", "inspector-session.png")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _session_address(demo: subprocess.Popen[str], timeout: float = 180) -> str:
    """The demo's session page, from what it prints once its session is replayed."""
    assert demo.stdout is not None
    deadline = time.monotonic() + timeout
    for line in demo.stdout:
        if "this session: " in line:
            return line.split("this session: ", 1)[1].strip()
        if time.monotonic() > deadline:
            break
    raise RuntimeError(f"the demo printed no session address (exit {demo.poll()})")


def _wait(browser: object, heading: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if browser.heading() == heading:  # type: ignore[attr-defined]
            return
        time.sleep(0.1)
    raise RuntimeError(f"no page headed {heading!r}")


def take(out: Path) -> list[Path]:
    sys.path.insert(0, str(ROOT))  # the suite's WebDriver client, in a development checkout
    from tests.webdriver import Browser

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        raise RuntimeError("no chromium/chromedriver: apt-get install chromium chromium-driver")
    out.mkdir(parents=True, exist_ok=True)
    admin_key = "shots-" + secrets.token_hex(12)
    with tempfile.TemporaryDirectory() as data:
        demo = subprocess.Popen(
            [sys.executable, "-m", "runloop_proxy", "demo", "--port", str(_free_port()),
             "--admin-key", admin_key, "--data-dir", data],
            stdout=subprocess.PIPE, text=True, cwd=data)
        try:
            session = _session_address(demo)
            base = session.split("/admin/ui", 1)[0]
            browser = Browser(chromium, driver, size=(1480, 1100))
            try:
                browser.get(base + "/admin/ui/login")
                browser.css("input[name=key]").send_keys(admin_key)
                browser.css("button[type=submit]").click()
                _wait(browser, "Sessions")
                written = [out / SHOTS[0]]
                browser.screenshot(written[0])
                browser.get(session)
                _wait(browser, "Session " + session.rsplit("id=", 1)[1])
                written.append(out / SHOTS[1])
                browser.screenshot(written[1])
            finally:
                browser.quit()
        finally:
            demo.send_signal(signal.SIGINT)
            try:
                demo.wait(30)
            except subprocess.TimeoutExpired:
                demo.kill()
                demo.wait()
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs",
                        help="where the PNGs go (default: docs/)")
    args = parser.parse_args()
    for path in take(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
