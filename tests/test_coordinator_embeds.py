"""coordinator.embeds: embedding requests go to the least busy embed worker of their model, are
forgotten when it answers, and fail at once (503) when it dies; other models are refused."""

from __future__ import annotations

from pdserve.coordinator.coordinator import Coordinator
from pdserve.protocol import messages as m
from pdserve.protocol.control import KVLayout, Register
from tests.test_coordinator_waits import Outbox, register

EMBED_LAYOUT = KVLayout(block_size=1, dtype="float32", num_layers=1, num_kv_heads=1, head_dim=384)


def cluster() -> tuple[Coordinator, Outbox]:
    out = Outbox()
    c = Coordinator(out, heartbeat_timeout_s=5.0)
    register(c, "prefill", "p0", 64)  # "tiny": a generative model
    register(c, "decode", "d0", 64)
    for wid in ("e0", "e1"):
        info = Register(
            role="embed",
            worker_id=wid,
            model="minilm",
            control_address=wid,
            transfer_address="",
            transfer_backend="zmq",
            layout=EMBED_LAYOUT,
            num_blocks=1,
            max_model_len=256,
        )
        c.handle(info, 0.0)
    return c, out


def embed(rid: str, tokens: int, model: str = "minilm") -> m.Embed:
    return m.Embed(request_id=rid, model=model, inputs=[[1] * tokens], stream_address="gw")


def test_requests_spread_by_tokens_in_flight_and_are_forgotten_when_answered() -> None:
    c, out = cluster()
    for rid, tokens in (("a", 100), ("b", 10), ("c", 5), ("d", 1)):
        c.handle(embed(rid, tokens), 0.0)
    sent = {msg.request_id: wid for wid, msg in out.take(m.Embed)}  # type: ignore[attr-defined]
    # a → e0 (both idle), b → e1, c → e1 (10 < 100), d → e1 (15 < 100)
    assert sent == {"a": "e0", "b": "e1", "c": "e1", "d": "e1"}
    c.handle(m.Finished(request_id="a", choice=0, worker_id="e0"), 0.1)
    c.handle(m.Abort("d", "timeout"), 0.1)  # the gateway gave up: its worker drops it
    assert out.take(m.Abort) == [("e1", m.Abort("d", "timeout"))]
    assert set(c.embeds.in_flight) == {"b", "c"}
    c.handle(embed("e", 1), 0.1)
    assert out.take(m.Embed) == [("e0", embed("e", 1))]
    assert out.gateway == [] and c.routes == {}


def test_a_dead_embed_worker_fails_its_requests_at_once() -> None:
    c, out = cluster()
    c.handle(embed("a", 3), 0.0)
    [(wid, _)] = out.take(m.Embed)
    for other in ("p0", "d0", "e0", "e1"):  # all but the one holding "a" keep beating
        if other != wid:
            c.handle(Register(**{**vars(c.registry.workers[other].info)}), 4.0)
    c.tick(6.0)
    assert out.gateway == [
        m.RequestError(request_id="a", status=503, message=f"embed worker {wid} stopped responding")
    ]
    assert c.embeds.in_flight == {}


def test_other_models_are_refused_and_generation_on_an_embedding_model_too() -> None:
    c, out = cluster()
    c.handle(embed("a", 3, model="tiny"), 0.0)
    c.handle(embed("b", 3, model="nope"), 0.0)
    statuses = [(e.request_id, e.status) for e in out.gateway]  # type: ignore[attr-defined]
    assert statuses == [("a", 400), ("b", 404)]
    out.gateway.clear()
    generate = m.Generate(
        request_id="g",
        model="minilm",
        prompt_token_ids=[1, 2],
        sampling=m.SamplingParams(max_tokens=2),
        n=1,
        stream_address="gw",
    )
    c.handle(generate, 0.0)
    [error] = out.gateway
    assert isinstance(error, m.RequestError) and error.status == 400
    assert "embedding model" in error.message
    state = c.registry.cluster_state()
    kinds = {s.name: (s.kind, s.ready) for s in state.models}
    assert kinds == {"tiny": ("generate", True), "minilm": ("embed", True)}


def test_a_restarted_embed_worker_fails_what_its_old_process_had() -> None:
    c, out = cluster()
    c.handle(embed("a", 3), 0.0)
    [(wid, _)] = out.take(m.Embed)
    info = c.registry.workers[wid].info
    c.handle(Register(**{**vars(info), "control_address": "new"}), 1.0)  # a new process
    [error] = out.gateway
    assert isinstance(error, m.RequestError) and (error.request_id, error.status) == ("a", 503)
    assert c.embeds.in_flight == {} and c.registry.workers[wid].info.control_address == "new"
