"""Services started by tests (Ray nodes, MLflow, an S3 server) on 127.0.0.1, stopped by process id.

Each service runs in its own process session, so stopping it means signalling exactly that
session (the service and the children it spawned), never `ray stop` (which would kill every Ray
on the machine, other tests' included).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(log_path, "ab")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})


def session_pids(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True).stdout
    return [int(p) for p, s in (line.split() for line in out.splitlines()) if int(s) == sid]


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM the process's session, then SIGKILL what is left of it."""
    sid = proc.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = session_pids(sid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + (timeout_s if sig == signal.SIGTERM else 10)
        while time.time() < deadline and session_pids(sid):
            time.sleep(0.5)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def wait_http(url: str, timeout_s: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout_s
    last: Exception | None = None
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status < 500:
                    return
        except OSError as e:
            last = e
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer in {timeout_s} s ({last})")


class RayHead:
    """`ray start --head --block` on 127.0.0.1 with its own ports and temp dir."""

    def __init__(self, tmp: Path, num_cpus: int = 2, resources: str | None = None):
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.tmp = tmp
        cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
               f"--port={self.gcs_port}", "--dashboard-host=127.0.0.1",
               f"--dashboard-port={self.dashboard_port}", f"--num-cpus={num_cpus}",
               "--disable-usage-stats", "--include-dashboard=true"]
        if resources:
            cmd.append(f"--resources={resources}")
        self.proc = start(cmd, tmp / "ray-head.log", env={"RAY_USAGE_STATS_ENABLED": "0"})
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        wait_http(self.dashboard + "/api/version", proc=self.proc)

    def add_worker(self, num_cpus: int, resources: str | None = None, name: str = "worker") -> subprocess.Popen:
        cmd = [str(BIN / "ray"), "start", "--block", f"--address={self.address}",
               "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", "--disable-usage-stats"]
        if resources:
            cmd.append(f"--resources={resources}")
        return start(cmd, self.tmp / f"ray-{name}.log", env={"RAY_USAGE_STATS_ENABLED": "0"})

    def stop(self) -> None:
        stop(self.proc)
