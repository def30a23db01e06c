"""Real clusters for end-to-end tests: ``pdserve serve`` as a child process on free ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pdserve.runtime.sockets import free_port

PDSERVE = [sys.executable, "-m", "pdserve.launch.cli"]
LOCAL_SH = ["bash", str(Path(__file__).resolve().parents[1] / "launch" / "local.sh")]


class ServedCluster:
    def __init__(
        self, model: Path, *flags: str, ready_timeout: float = 180.0, command: list[str] = PDSERVE
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_name = model.name
        # A file, never a pipe: nobody reads a pipe while the test runs, and a cluster that
        # logs more than the pipe holds blocks in its next write (the gateway stops answering).
        fd, name = tempfile.mkstemp(prefix="pdserve-serve-", suffix=".log")
        os.close(fd)
        self._log = Path(name)
        self._final: str | None = None
        with open(self._log, "ab") as log:  # O_APPEND: reading it never moves the writer
            self.proc = subprocess.Popen(
                [*command, "serve", f"--model={model}", f"--port={self.port}", *flags],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve serve exited:\n{self.output()}")
            if self.healthy():
                return
            time.sleep(0.2)
        raise RuntimeError(f"cluster not healthy in time:\n{self.stop()[-4000:]}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=60) as r:
            return r.read().decode()

    def kv_blocks_used(self) -> dict[str, float]:
        pattern = r"^pdserve_kv_blocks_used\{([^}]*)\} (\S+)$"
        out = {}
        for labels, value in re.findall(pattern, self.metrics(), re.MULTILINE):
            worker = re.search(r'worker="([^"]+)"', labels).group(1)
            out[worker] = float(value)
        return out

    def worker_steps(self) -> dict[str, float]:
        """Engine steps each worker ran since it started (every kind), as its last heartbeat
        told: a counter, so a short request shows where a blocks-used gauge may miss it."""
        pattern = r'^pdserve_worker_step_seconds_count\{[^}]*worker="([^"]+)"[^}]*\} (\S+)$'
        out: dict[str, float] = {}
        for worker, value in re.findall(pattern, self.metrics(), re.MULTILINE):
            out[worker] = out.get(worker, 0.0) + float(value)
        return out

    def gateway_in_flight(self) -> float:
        """Generation requests the gateway holds now (an abandoned one until it lets go)."""
        found = re.search(r"^pdserve_gateway_requests_in_flight (\S+)$", self.metrics(), re.M)
        return float(found.group(1))

    def wait_blocks_free(self, timeout: float = 120.0) -> dict[str, float]:
        """Every worker's blocks in use, once all are 0 (each worker reports with its next
        heartbeat) or ``timeout`` passed (a deadline that only catches blocks never freed)."""
        deadline = time.monotonic() + timeout
        used = self.kv_blocks_used()
        while time.monotonic() < deadline and (not used or any(used.values())):
            time.sleep(0.1)
            used = self.kv_blocks_used()
        return used

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._final is None:
            self._final = self.output()
            self._log.unlink(missing_ok=True)
        return self._final

    def output(self) -> str:
        """Everything the cluster printed so far."""
        if self._final is not None:
            return self._final
        return self._log.read_text(errors="replace")
