"""A role's stop on SIGTERM / SIGINT: a burst of signals never hangs it.

Its handler once set a ``threading.Event``; a second signal arriving while the first
handler's ``set`` held the Event's lock re-entered the handler on the same thread and waited
on that lock forever (a prefill worker outlived its cluster so). ``StopFlag`` takes no lock.
"""

from __future__ import annotations

import signal
import subprocess
import sys

CHILD = """
import sys, time
from pdserve.runtime.loop import stop_on_signals
stop = stop_on_signals()
print("ready", flush=True)
while not stop.is_set():
    time.sleep(0.0001)
print("stopped", flush=True)
"""


def test_a_burst_of_signals_stops_the_loop_and_never_hangs_it() -> None:
    for _ in range(15):  # the Event hung 4 times in 30 such bursts (2026-11-29)
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        for i in range(200):
            child.send_signal(signal.SIGTERM if i % 2 else signal.SIGINT)
        try:
            out, _ = child.communicate(timeout=10)
        finally:
            child.kill()
        # the loop saw the flag and ended; signals still arriving as the interpreter exits
        # may end it with their default action (a negative return code), never hang it
        assert out.strip() == "stopped", (child.returncode, out)
