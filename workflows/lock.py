"""One driver per work dir: a second run refuses to start instead of corrupting the first.

Local work dir: ``fcntl.flock`` on ``<work_dir>/.lock`` (released by the OS when the driver dies,
so a killed driver never blocks its own resume). Object-store work dir: a lock object with the
owner and a heartbeat; a lock whose heartbeat is older than ``stale_after_s`` is taken over.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from pipeline import storage


class WorkDirBusy(RuntimeError):
    pass


class WorkDirLock:
    def __init__(self, work_dir: str, heartbeat_s: float = 30.0, stale_after_s: float = 180.0):
        self.work_dir = storage.absolute(work_dir)
        self.uri = storage.join(self.work_dir, ".lock")
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.owner = {"host": socket.gethostname(), "pid": os.getpid()}

    def __enter__(self) -> "WorkDirLock":
        storage.makedirs(self.work_dir)
        if storage.is_remote(self.uri):
            self._acquire_remote()
        else:
            self._acquire_local()
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            storage.rmtree(self.uri)

    def holder(self) -> str | None:
        """Who holds the lock now (e.g. for ``--plan``), without taking it; None when nobody does."""
        if storage.is_remote(self.uri):
            try:
                data = storage.read_json(self.uri)
            except (FileNotFoundError, OSError, ValueError):
                return None
            if time.time() - float(data.get("heartbeat", 0)) >= self.stale_after_s:
                return None
            return f"{data.get('host')} pid {data.get('pid')}"
        import fcntl

        try:
            fd = os.open(self.uri, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 4096).decode(errors="replace")
            try:
                data = json.loads(text)
                return f"{data.get('host')} pid {data.get('pid')}"
            except ValueError:
                return text.strip() or "another process"
        finally:
            os.close(fd)  # closing also drops the shared lock, when it was granted
        return None

    def _acquire_local(self) -> None:
        import fcntl

        path = Path(self.uri)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = path.read_text(errors="replace").strip() or "another process"
            os.close(fd)
            raise WorkDirBusy(f"work dir {self.work_dir} is in use by {holder}; "
                              "wait for that run to finish or use another run.work_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({**self.owner, "since": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode())
        self._fd = fd

    def _acquire_remote(self) -> None:
        if storage.exists(self.uri):
            try:
                holder = storage.read_json(self.uri)
            except (OSError, ValueError):
                holder = {}
            age = time.time() - float(holder.get("heartbeat", 0))
            if age < self.stale_after_s and holder.get("token") != self._token():
                raise WorkDirBusy(f"work dir {self.work_dir} is in use by {holder.get('host')} pid "
                                  f"{holder.get('pid')} (heartbeat {age:.0f} s ago); wait for it or "
                                  f"remove {self.uri} if that driver is gone")
        self._beat()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="workdir-lock")
        self._thread.start()

    def _token(self) -> str:
        return f"{self.owner['host']}:{self.owner['pid']}"

    def _beat(self) -> None:
        storage.write_json(self.uri, {**self.owner, "token": self._token(), "heartbeat": time.time()})

    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._beat()
            except OSError:
                pass
