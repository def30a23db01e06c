"""The role processes ``pdserve serve`` supervises: started in their own session, restarted
when they die (up to ``--max-restarts``), stopped by SIGTERM then killed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Child:
    """One role process; restarted (same command line) if it dies while serving."""

    role: str
    cmd: list[str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    # a canary version's worker (launch.versions): restarted for as long as serve runs, each
    # time after a longer pause (up to EXPENDABLE_PAUSE_S), never fatal to serve
    expendable: bool = False
    paused_until: float = 0.0

    def start(self) -> None:
        # own session: a terminal's Ctrl-C reaches `serve` alone, which stops roles in order;
        # PDEATHSIG: a role never outlives a `serve` that was killed outright
        self.proc = subprocess.Popen(self.cmd, start_new_session=True, preexec_fn=_die_with_parent)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM, not waited for: a worker drains (finishes its streams, takes nothing new)."""
        if self.proc is not None and self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL, not waited for (``alive`` reaps it)."""
        if self.proc is not None and self.alive():
            self.proc.kill()

    def stop(self, timeout_s: float) -> None:
        proc = self.proc
        if proc is None or not self.alive():
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            print(
                f"pdserve serve: {self.role} did not stop in {timeout_s:.0f}s; killing it",
                file=sys.stderr,
            )
            proc.kill()
            proc.wait()


EXPENDABLE_PAUSE_S = 30.0


def restart(child: Child, max_restarts: int) -> None:
    code = child.proc.returncode if child.proc else None
    if child.expendable:
        now = time.monotonic()
        if now < child.paused_until:
            return
        child.paused_until = now + min(EXPENDABLE_PAUSE_S, 2.0**child.restarts)
    elif child.restarts >= max_restarts:
        raise RuntimeError(f"{child.role} exited ({code}) {child.restarts + 1} times; giving up")
    child.restarts += 1
    limit = "a canary version's: no limit" if child.expendable else max_restarts
    print(
        f"pdserve serve: {child.role} exited ({code}); restarting it ({child.restarts}/{limit})",
        file=sys.stderr,
        flush=True,
    )
    child.start()


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def wait_for_file(path: Path, child: Child, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        if not child.alive():
            raise RuntimeError("the coordinator exited during start-up")
        time.sleep(0.05)
    raise RuntimeError(f"the coordinator did not start within {timeout:.0f}s")
