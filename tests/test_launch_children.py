"""launch/children.py with real processes: the restart policy ``pdserve serve`` applies to a
role that exits (any exit while serving, up to ``--max-restarts``, then it gives up), the stop
(SIGTERM, then SIGKILL after the timeout), each role in its own session and dying with its
parent, and the wait for the coordinator's address file."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.launch.children import Child, restart, wait_for_file

HANG_S = 60.0  # only a hang takes this long

# Each writes its argv[1] file (atomically) once its SIGTERM handling is in place.
READY = (
    "import os, sys\n"
    "def ready(text='ready'):\n"
    "    open(sys.argv[1] + '.tmp', 'w').write(text)\n"
    "    os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
)
IGNORES_SIGTERM = READY + (
    "import signal\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "ready()\n"
    "while True:\n"
    "    signal.pause()\n"
)
STOPS_ON_SIGTERM = READY + (
    "import signal\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "ready('  tcp://127.0.0.1:5555\\n')\n"
    "while True:\n"
    "    signal.pause()\n"
)


def python(script: str, *argv: str) -> list[str]:
    return [sys.executable, "-c", script, *argv]


@pytest.fixture
def children() -> Iterator[list[Child]]:
    """Children a test made; any still running at its end is killed."""
    made: list[Child] = []
    yield made
    for child in made:
        if child.alive():
            child.proc.kill()
            child.proc.wait()


def started(children: list[Child], role: str, cmd: list[str]) -> Child:
    child = Child(role, cmd)
    children.append(child)
    child.start()
    return child


def test_a_role_that_keeps_crashing_is_restarted_then_given_up_on(
    children: list[Child], capsys: pytest.CaptureFixture[str]
) -> None:
    child = started(children, "prefill", python("import sys; sys.exit(3)"))
    pids = []
    for n in (1, 2):
        pids.append(child.proc.pid)
        assert child.proc.wait(HANG_S) == 3
        assert not child.alive()
        restart(child, max_restarts=2)  # the same command line, a new process
        assert child.restarts == n
    pids.append(child.proc.pid)
    assert child.proc.wait(HANG_S) == 3
    with pytest.raises(RuntimeError) as e:
        restart(child, max_restarts=2)
    assert str(e.value) == "prefill exited (3) 3 times; giving up"
    assert child.restarts == 2
    assert len(set(pids)) == 3
    assert capsys.readouterr().err == (
        "pdserve serve: prefill exited (3); restarting it (1/2)\n"
        "pdserve serve: prefill exited (3); restarting it (2/2)\n"
    )


def test_no_restarts_allowed_gives_up_at_the_first_exit(children: list[Child]) -> None:
    child = started(children, "gateway", python("import sys; sys.exit(1)"))
    assert child.proc.wait(HANG_S) == 1
    with pytest.raises(RuntimeError, match=r"^gateway exited \(1\) 1 times; giving up$"):
        restart(child, max_restarts=0)
    assert child.restarts == 0


def test_a_clean_exit_while_serving_is_restarted_too(
    children: list[Child], capsys: pytest.CaptureFixture[str]
) -> None:
    """Roles serve until ``serve`` stops them, so any exit before that is a role gone
    missing: exit code 0 is restarted like a crash (and counts against the limit)."""
    child = started(children, "decode", python("pass"))
    assert child.proc.wait(HANG_S) == 0
    first = child.proc
    restart(child, max_restarts=5)
    assert (child.restarts, child.proc is first) == (1, False)
    assert child.proc.wait(HANG_S) == 0
    assert capsys.readouterr().err == "pdserve serve: decode exited (0); restarting it (1/5)\n"


def test_a_role_killed_by_a_signal_is_reported_with_it(
    children: list[Child], capsys: pytest.CaptureFixture[str]
) -> None:
    child = started(children, "coordinator", python("import signal\nwhile True: signal.pause()"))
    child.proc.kill()
    assert child.proc.wait(HANG_S) == -signal.SIGKILL
    restart(child, max_restarts=1)
    assert child.alive()
    assert capsys.readouterr().err == (
        "pdserve serve: coordinator exited (-9); restarting it (1/1)\n"
    )


def test_stop_asks_with_sigterm_first(
    children: list[Child], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ready = tmp_path / "ready"
    child = started(children, "gateway", python(STOPS_ON_SIGTERM, str(ready)))
    assert wait_for_file(ready, child, HANG_S) == "tcp://127.0.0.1:5555"  # stripped
    child.stop(HANG_S)
    assert (child.alive(), child.proc.returncode) == (False, 0)
    assert capsys.readouterr().err == ""  # it was never killed


def test_a_role_that_ignores_sigterm_is_killed_after_the_timeout(
    children: list[Child], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ready = tmp_path / "ready"
    child = started(children, "decode", python(IGNORES_SIGTERM, str(ready)))
    assert wait_for_file(ready, child, HANG_S) == "ready"
    child.stop(timeout_s=1)
    assert (child.alive(), child.proc.returncode) == (False, -signal.SIGKILL)
    assert capsys.readouterr().err == "pdserve serve: decode did not stop in 1s; killing it\n"


def test_stop_leaves_an_exited_or_unstarted_role_alone(children: list[Child]) -> None:
    child = started(children, "prefill", python("import sys; sys.exit(4)"))
    assert child.proc.wait(HANG_S) == 4
    child.stop(HANG_S)
    assert child.proc.returncode == 4
    never = Child("decode", python("pass"))
    never.stop(HANG_S)
    assert (never.proc, never.alive()) == (None, False)


def test_each_role_leads_its_own_session(children: list[Child]) -> None:
    """A terminal's Ctrl-C reaches ``serve`` alone, which stops the roles in order."""
    child = started(children, "gateway", python("import signal\nwhile True: signal.pause()"))
    assert os.getsid(child.proc.pid) == child.proc.pid != os.getsid(0)


def test_a_role_dies_with_a_serve_that_was_killed_outright() -> None:
    """PR_SET_PDEATHSIG: a ``serve`` killed with SIGKILL takes its roles with it."""
    parent = subprocess.Popen(
        python(
            "import sys\n"
            "from pdserve.launch.children import Child\n"
            "c = Child('decode', [sys.executable, '-c', "
            "'import signal\\nwhile True: signal.pause()'])\n"
            "c.start()\n"
            "print(c.proc.pid, flush=True)\n"
            "sys.stdin.read()\n"
        ),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    role = int(parent.stdout.readline())
    pidfd = os.pidfd_open(role)  # readable once the role has exited
    gone: list = []
    try:
        parent.kill()
        parent.wait(HANG_S)
        gone, _, _ = select.select([pidfd], [], [], HANG_S)
        assert gone, "the role outlived its killed parent"
    finally:
        if not gone:
            os.kill(role, signal.SIGKILL)
        os.close(pidfd)
        parent.stdin.close()
        parent.stdout.close()


def test_waiting_for_the_address_file_fails_when_the_coordinator_does(
    children: list[Child], tmp_path: Path
) -> None:
    dead = started(children, "coordinator", python("import sys; sys.exit(1)"))
    with pytest.raises(RuntimeError) as e:
        wait_for_file(tmp_path / "never", dead, HANG_S)
    assert str(e.value) == "the coordinator exited during start-up"
    silent = started(children, "coordinator", python("import signal\nwhile True: signal.pause()"))
    with pytest.raises(RuntimeError) as e:
        wait_for_file(tmp_path / "never", silent, 1)
    assert str(e.value) == "the coordinator did not start within 1s"
    assert silent.alive()  # waiting never stops it; serve's exit path does
