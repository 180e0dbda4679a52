"""Services started by tests (Ray nodes, MLflow, an S3 server) on 127.0.0.1, stopped by process id.

Each service runs in its own process session, so stopping it means signalling exactly that
session (the service and the children it spawned), never `ray stop` (which would kill every Ray
on the machine, other tests' included).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
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
    """Live processes of session `sid` (zombies, already dead but not yet reaped, are left out)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid=,stat="], capture_output=True, text=True).stdout
    return [int(p) for p, s, stat in (line.split() for line in out.splitlines())
            if int(s) == sid and not stat.startswith("Z")]


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM the process's session, then SIGKILL what is left of it after `timeout_s`;
    `timeout_s=0`: SIGKILL at once (a node or server lost without notice: a SIGTERM first would let
    it shut down in order, or reach a Ray Train worker's preemption handler, racing the kill)."""
    sid = proc.pid
    for sig in (signal.SIGTERM, signal.SIGKILL) if timeout_s > 0 else (signal.SIGKILL,):
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
            time.sleep(0.1)
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
        except urllib.error.HTTPError as e:  # it answers: 401/403 when Ray token auth is on
            if e.code < 500:
                return
            last = e
        except OSError as e:
            last = e
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer in {timeout_s} s ({last})")


def _own_ports() -> list[str]:
    """Ports Ray would otherwise take at fixed defaults (the dashboard agent's 52365): another Ray on
    the machine holding one leaves this node without a job agent ("No available agent to submit job")."""
    return [f"--dashboard-agent-listen-port={free_port()}"]


class RayHead:
    """`ray start --head --block` on 127.0.0.1 with its own ports and temp dir.

    A test's nodes end with SIGKILL to their sessions (`stop(proc, timeout_s=0)`): nothing of a
    test's cluster needs an orderly shutdown, and `ray start --block` given SIGTERM had not ended
    after 5 s (measured), so each head cost the SIGTERM wait and then the kill anyway."""

    def __init__(self, tmp: Path, num_cpus: int = 2, resources: str | None = None,
                 env: dict[str, str] | None = None):
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.tmp = tmp
        # Its own Ray temp dir (short: socket paths have a ~107-byte limit): `ray start` records the
        # cluster's address in <temp dir>/ray_current_cluster, and a plain `ray.init()` anywhere on the
        # machine joins the cluster named in /tmp/ray/ray_current_cluster, or hangs on it once the
        # cluster is stopped. Session logs are under `self.temp_dir/session_latest/logs` while the head
        # runs, and under `self.logs` once it is stopped.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
               f"--temp-dir={self.temp_dir}",
               f"--port={self.gcs_port}", "--dashboard-host=127.0.0.1",
               f"--dashboard-port={self.dashboard_port}", f"--num-cpus={num_cpus}",
               "--disable-usage-stats", "--include-dashboard=true", *_own_ports(),
               f"--ray-client-server-port={free_port()}"]
        if resources:
            cmd.append(f"--resources={resources}")
        self.proc = start(cmd, tmp / "ray-head.log", env={"RAY_USAGE_STATS_ENABLED": "0", **(env or {})})
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        wait_http(self.dashboard + "/api/version", proc=self.proc)

    def add_worker(self, num_cpus: int, resources: str | None = None, name: str = "worker") -> subprocess.Popen:
        cmd = [str(BIN / "ray"), "start", "--block", f"--address={self.address}",
               "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", "--disable-usage-stats", *_own_ports()]
        if resources:
            cmd.append(f"--resources={resources}")
        return start(cmd, self.tmp / f"ray-{name}.log", env={"RAY_USAGE_STATS_ENABLED": "0"})

    @property
    def logs(self) -> Path:
        """The session's logs once the head is stopped: in the test's own folder, which pytest keeps
        for its last few runs."""
        return self.tmp / "ray-logs"

    def stop(self) -> None:
        """SIGKILL the head's session, move its logs to `self.logs` and remove its temp dir (~3.5 MB a
        head, which would otherwise stay in /tmp after every run)."""
        stop(self.proc, timeout_s=0)
        session = self.temp_dir / "session_latest" / "logs"
        if session.is_dir():
            shutil.copytree(session, self.logs, dirs_exist_ok=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def wait_for(what: str, cond, driver: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    """Poll `cond()` until true; fail naming `what` (with the driver's log) if the driver ends first
    or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert driver.poll() is None, f"the driver ended while waiting for {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
