"""A W3C WebDriver client over httpx, enough for the inspector's browser test: Debian's
chromedriver and chromium, headless, driven through the WebDriver HTTP protocol (what Selenium
speaks underneath), so the test extras need no browser library. Nothing is downloaded."""

from __future__ import annotations

import base64
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from .conftest import free_port, until

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference


class WebDriverError(AssertionError):
    pass


class Browser:
    """One headless chromium session behind its own chromedriver process."""

    def __init__(self, chromium: str, chromedriver: str, size: tuple[int, int] = (1280, 1400)):
        self.port = free_port()
        self._proc = subprocess.Popen([chromedriver, f"--port={self.port}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)
        try:
            until(self._ready, timeout=30, what="chromedriver to answer")
            args = ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                    "--disable-gpu", f"--window-size={size[0]},{size[1]}"]
            caps = {"browserName": "chrome",
                    "goog:chromeOptions": {"binary": chromium, "args": args}}
            self.session = self._call("POST", "/session",
                                      {"capabilities": {"alwaysMatch": caps}})["sessionId"]
        except BaseException:
            self._stop()
            raise

    @classmethod
    def start_or_skip(cls) -> Browser:
        import pytest

        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        driver = shutil.which("chromedriver")
        if not chromium or not driver:
            pytest.skip("no chromium/chromedriver: apt-get install chromium chromium-driver")
        return cls(chromium, driver)

    def _ready(self) -> bool:
        try:
            return bool(self._http.get("/status").json()["value"]["ready"])
        except httpx.HTTPError:
            return False

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        r = self._http.request(method, path, json=body if method == "POST" else None)
        value = r.json().get("value")
        if r.status_code != 200:
            raise WebDriverError(f"{method} {path}: {r.status_code} {value}")
        return value

    def _s(self, path: str) -> str:
        return f"/session/{self.session}{path}"

    # -- the commands the test uses --------------------------------------------------------

    def get(self, url: str) -> None:
        self._call("POST", self._s("/url"), {"url": url})

    @property
    def current_url(self) -> str:
        return str(self._call("GET", self._s("/url")))

    def find(self, using: str, value: str) -> Element:
        found = self._call("POST", self._s("/element"), {"using": using, "value": value})
        return Element(self, found[ELEMENT])

    def find_all(self, using: str, value: str) -> list[Element]:
        found = self._call("POST", self._s("/elements"), {"using": using, "value": value})
        return [Element(self, f[ELEMENT]) for f in found]

    def css(self, selector: str) -> Element:
        return self.find("css selector", selector)

    def css_all(self, selector: str) -> list[Element]:
        return self.find_all("css selector", selector)

    def script(self, source: str, *args: Any) -> Any:
        return self._call("POST", self._s("/execute/sync"), {"script": source, "args": list(args)})

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self._call("GET", self._s("/screenshot"))))

    def heading(self) -> str:
        try:
            return self.css("h1").text
        except WebDriverError:  # between two pages
            return ""

    def navigate(self, clicked: Element, heading: str) -> None:
        """Click and wait for the next page headed ``heading``: the old page's document must
        go first (a form may post back to a page of the same heading)."""
        marker = f"rl{time.monotonic_ns()}"
        self.script(f"window.{marker} = 1;")
        clicked.click()

        def arrived() -> bool:
            try:
                left = not self.script(f"return window.{marker} === 1;")
            except WebDriverError:  # mid-navigation
                return False
            return left and self.heading() == heading
        until(arrived, timeout=10, what=f"a page headed {heading!r}")

    def quit(self) -> None:
        try:
            self._call("DELETE", self._s(""))
        finally:
            self._stop()

    def _stop(self) -> None:
        self._http.close()
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class Element:
    def __init__(self, browser: Browser, ref: str):
        self._b = browser
        self._path = browser._s(f"/element/{ref}")

    @property
    def text(self) -> str:
        return str(self._b._call("GET", self._path + "/text"))

    def attribute(self, name: str) -> str | None:
        value = self._b._call("GET", self._path + f"/attribute/{name}")
        return None if value is None else str(value)

    def find_all(self, using: str, value: str) -> list[Element]:
        """The elements inside this one."""
        found = self._b._call("POST", self._path + "/elements", {"using": using, "value": value})
        return [Element(self._b, f[ELEMENT]) for f in found]

    def click(self) -> None:
        self._b._call("POST", self._path + "/click", {})

    def send_keys(self, text: str) -> None:
        self._b._call("POST", self._path + "/value", {"text": text})
