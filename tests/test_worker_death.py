"""A worker that stops heartbeating: work it had not started moves, started work fails
cleanly (an error to the gateway, every other worker's blocks freed)."""

from __future__ import annotations

import time

from pdserve.decode.record import DecodeState
from pdserve.protocol import messages as m
from pdserve.worker.wire import heartbeat
from tests.cluster_util import Cluster
from tests.engine_util import hf_greedy, make_engine, prompts

SPEC = m.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def kill(cluster: Cluster, dead: str) -> None:
    """``dead`` goes silent: its queued messages are lost, the others heartbeat on, and the
    coordinator's clock passes the heartbeat timeout."""
    cluster.bus.queue = type(cluster.bus.queue)(
        (dest, msg) for dest, msg in cluster.bus.queue if dest != dead
    )
    worker = cluster.workers.pop(dead)
    later = time.monotonic() + 60
    for wid, w in cluster.workers.items():
        cluster.coordinator.handle(heartbeat(w.engine, wid, w.queued_prompt_tokens), later)
    cluster.coordinator.tick(later)
    if hasattr(worker, "receiver") and worker.receiver is not None:
        worker.receiver.close()
    elif hasattr(worker, "sender"):
        worker.sender.close()


def kill_while_decoding(cluster: Cluster, rounds: int = 3) -> list[int]:
    """Pump until a decode worker runs the request, ``rounds`` more, then kill that worker;
    the tokens the gateway got before its death, in index order."""
    while not any(w.keys_in(DecodeState.RUNNING) for w in cluster.workers.values()):
        cluster.pump_round()
    for _ in range(rounds):
        cluster.pump_round()
    [dead] = [wid for wid, w in cluster.workers.items() if w.keys_in(DecodeState.RUNNING)]
    kill(cluster, dead)
    cluster.pump()
    return [t for c in sorted(cluster.chunks(), key=lambda c: c.index) for t in c.token_ids]


def resume(
    cluster: Cluster, rid: str, prompt: list[int], spec: m.SamplingParams, so_far: list[int]
) -> list[int]:
    """What the gateway does: resume choice 0 after the tokens it has; the tokens after them."""
    cluster.bus.gateway["gw"].clear()
    resumed = m.Generate(
        request_id=rid,
        model="tiny",
        prompt_token_ids=prompt,
        sampling=spec,
        n=1,
        stream_address="gw",
        resume_choice=0,
        resume_token_ids=so_far,
    )
    cluster.bus.queue.append(("coordinator", resumed))
    cluster.pump()
    return cluster.tokens(rid, start=len(so_far))[0]  # no gap in token indices


def make(tiny_dir, num_p: int, num_d: int) -> Cluster:
    return Cluster(
        [make_engine(tiny_dir) for _ in range(num_p)], [make_engine(tiny_dir) for _ in range(num_d)]
    )


def test_reservation_moves_to_another_decode_worker(tiny_dir) -> None:
    cluster = make(tiny_dir, 1, 2)
    try:
        prompt = prompts(512, [9], seed=40)[0]
        cluster.submit("r", prompt, SPEC)
        cluster.deliver_next()  # the Generate
        [(dest, msg)] = list(cluster.bus.queue)
        assert isinstance(msg, m.Reserve)
        kill(cluster, dest)
        cluster.pump()
        assert cluster.tokens("r") == {0: hf_greedy(tiny_dir, prompt, 8)}
        assert set(cluster.used_blocks().values()) == {0}
    finally:
        cluster.close()


def test_prefill_moves_to_another_prefill_worker(tiny_dir) -> None:
    cluster = make(tiny_dir, 2, 1)
    try:
        prompt = prompts(512, [30], seed=41)[0]
        cluster.submit("r", prompt, SPEC)
        while not any(isinstance(msg, m.PrefillJob) for _, msg in cluster.bus.queue):
            cluster.deliver_next()
        [dest] = [d for d, msg in cluster.bus.queue if isinstance(msg, m.PrefillJob)]
        kill(cluster, dest)
        cluster.pump()
        assert cluster.tokens("r") == {0: hf_greedy(tiny_dir, prompt, 8)}
        assert set(cluster.used_blocks().values()) == {0}
    finally:
        cluster.close()


def test_decode_death_mid_stream_ends_with_an_error_and_frees_prefill(tiny_dir) -> None:
    cluster = make(tiny_dir, 1, 2)
    try:
        cluster.submit(
            "r",
            prompts(512, [12], seed=42)[0],
            m.SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True),
        )
        while not any(w.keys_in(DecodeState.RUNNING) for w in cluster.workers.values()):
            cluster.pump_round()
        [dead] = [wid for wid, w in cluster.workers.items() if w.keys_in(DecodeState.RUNNING)]
        kill(cluster, dead)
        cluster.pump()
        [error] = cluster.errors()
        assert error.request_id == "r" and error.status == 503
        assert set(cluster.used_blocks().values()) == {0}
        assert cluster.coordinator.routes == {}
        # the rest of the cluster keeps serving
        prompt = prompts(512, [6], seed=43)[0]
        cluster.submit("next", prompt, SPEC)
        cluster.pump()
        assert cluster.tokens("next") == {0: hf_greedy(tiny_dir, prompt, 8)}
    finally:
        cluster.close()


def test_resume_on_another_decode_worker_continues_exactly(tiny_dir) -> None:
    cluster = make(tiny_dir, 1, 2)
    try:
        prompt = prompts(512, [12], seed=44)[0]
        spec = m.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        cluster.submit("r", prompt, spec)
        so_far = kill_while_decoding(cluster)
        [error] = cluster.errors()
        assert (error.choice, error.retryable) == (0, True)
        assert 0 < len(so_far) < 40
        rest = resume(cluster, "r", prompt, spec, so_far)
        assert so_far + rest == hf_greedy(tiny_dir, prompt, 40)
        assert set(cluster.used_blocks().values()) == {0}
    finally:
        cluster.close()
