"""``pdserve serve`` as the child of a benchmark script: healthy when made, stopped by SIGTERM.

Only the scripts that start their own cluster use this; the harness (``pdserve bench``) is a
client of any server and never imports it.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class ServeProcess:
    """``pdserve serve --model MODEL --port <free port> FLAGS...``, healthy on return.

    Output goes to ``log`` (default: discarded). A cluster that exits or is not healthy in
    ``ready_timeout_s`` raises ``RuntimeError`` (with the log's tail when there is a log)."""

    def __init__(
        self,
        model: str | Path,
        flags: list[str],
        *,
        log: Path | None = None,
        ready_timeout_s: float = 180.0,
    ) -> None:
        from pdserve.launch.worker_commands import pdserve_command
        from pdserve.runtime.sockets import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [*pdserve_command(), "serve", f"--model={model}", f"--port={self.port}", *flags]
        if log is None:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        else:
            with log.open("w") as out:  # the child keeps its own descriptor
                self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(f"{shlex.join(cmd)} exited with {code}{self._tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1):
                    return
            except OSError:  # not up yet, or 503 until its workers register
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"the cluster was not healthy within {ready_timeout_s:.0f} s{self._tail()}"
        )

    def metrics(self) -> str:
        """The gateway's ``/metrics`` text now (worker figures as of their last heartbeat)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            body: bytes = r.read()  # urlopen's response is untyped
            return body.decode()

    def stop(self) -> None:
        """SIGTERM (the roles drain), then kill after 60 s; idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _tail(self) -> str:
        return "" if self.log is None else ":\n" + self.log.read_text(errors="replace")[-3000:]
