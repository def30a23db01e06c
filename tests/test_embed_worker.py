"""prefill/embed.py: the embed worker batches the requests waiting into one step, answers each
gateway with its own rows (the vectors the model gives each input alone), fails only the
request whose input is bad, drops an aborted one, and serves a pooled decoder the same way."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.embed.model import EmbeddingModel
from pdserve.prefill.embed import STEP_TOKENS, EmbedWorker, embed_register
from pdserve.prefill.embed_main import is_embedding_model
from pdserve.protocol import messages as m
from tests.test_embed_decoder import embedding_dir


class Outbox:
    def __init__(self) -> None:
        self.gateway: list[tuple[str, m.Message]] = []
        self.coordinator: list[m.Message] = []

    def to_gateway(self, address: str, msg: m.Message) -> None:
        self.gateway.append((address, m.decode(m.encode(msg))))

    def to_coordinator(self, msg: m.Message) -> None:
        self.coordinator.append(m.decode(m.encode(msg)))


@pytest.fixture(scope="module")
def minilm(embed_dir: Path) -> EmbeddingModel:
    return EmbeddingModel.from_dir(embed_dir)


def request(rid: str, inputs: list[list[int]], gateway: str = "gw") -> m.Embed:
    return m.Embed(request_id=rid, model="minilm", inputs=inputs, stream_address=gateway)


def rows(result: m.Message) -> np.ndarray:
    assert isinstance(result, m.EmbedResult)
    return np.frombuffer(result.vectors, "<f4").reshape(-1, result.dim)


def test_one_step_answers_every_waiting_request_with_its_own_rows(minilm) -> None:
    out = Outbox()
    worker = EmbedWorker(minilm, "embed-0", out)  # type: ignore[arg-type]
    texts = [["A man is eating food."], ["Two dogs play.", "short"], ["The new movie is great!"]]
    ids = [minilm.tokenize(t) for t in texts]
    for i, one in enumerate(ids):
        worker.handle(request(f"r{i}", one, gateway=f"gw{i % 2}"))
    assert worker.step() and not worker.waiting and not worker.step()  # all in one step
    assert [(a, x.request_id) for a, x in out.gateway] == [
        ("gw0", "r0"),
        ("gw1", "r1"),
        ("gw0", "r2"),
    ]
    for (_, result), one in zip(out.gateway, ids, strict=True):
        alone = minilm.embed(one).numpy()
        assert np.array_equal(rows(result), alone)  # its rows, the same bits as alone
        assert result.num_tokens == sum(len(x) for x in one)  # type: ignore[attr-defined]
    assert [(x.request_id, type(x).__name__) for x in out.coordinator] == [
        ("r0", "Finished"), ("r1", "Finished"), ("r2", "Finished")
    ]  # fmt: skip
    assert worker.embedded_tokens == sum(len(x) for one in ids for x in one)
    beat = worker.heartbeat()
    assert (beat.load.waiting, beat.counters.prefill_tokens) == (0, worker.embedded_tokens)


def test_a_bad_input_fails_its_request_only_and_an_abort_drops_one(minilm) -> None:
    out = Outbox()
    worker = EmbedWorker(minilm, "embed-0", out)  # type: ignore[arg-type]
    good = minilm.tokenize(["fine"])
    worker.handle(request("ok", good))
    worker.handle(request("bad", [[101, 10**6, 102]]))  # outside the vocabulary
    worker.handle(request("gone", good))
    worker.handle(m.Abort("gone", "client left"))
    assert worker.step()
    kinds = [(x.request_id, type(x).__name__) for _, x in out.gateway]
    assert kinds == [("ok", "EmbedResult"), ("bad", "RequestError")]
    [(_, error)] = [(a, x) for a, x in out.gateway if isinstance(x, m.RequestError)]
    assert error.status == 400 and "vocabulary" in error.message  # type: ignore[attr-defined]
    assert [x.request_id for x in out.coordinator] == ["ok", "bad"]


def test_a_step_takes_the_oldest_requests_within_its_token_budget(minilm) -> None:
    out = Outbox()
    worker = EmbedWorker(minilm, "embed-0", out)  # type: ignore[arg-type]
    long = [[101, *([2000] * 254), 102]] * (STEP_TOKENS // 256)  # a whole step's tokens
    worker.handle(request("big", long))
    worker.handle(request("next", [[101, 102]]))
    worker.step()
    assert [x.request_id for _, x in out.gateway] == ["big"] and len(worker.waiting) == 1
    worker.step()
    assert [x.request_id for _, x in out.gateway] == ["big", "next"]


def test_a_pooled_decoder_is_served_as_an_embedding_model(tiny_dir, tmp_path) -> None:
    path = embedding_dir(tiny_dir, tmp_path / "tiny-embed", "lasttoken", normalize=True)
    assert is_embedding_model(str(path)) and not is_embedding_model(str(tiny_dir))
    model = EmbeddingModel.from_dir(path)
    out = Outbox()
    worker = EmbedWorker(model, "embed-0", out)  # type: ignore[arg-type]
    worker.handle(request("r", [[5, 9, 200], [7]]))
    worker.step()
    vectors = rows(out.gateway[0][1])
    assert vectors.shape == (2, 64) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-6)
    args = argparse.Namespace(model=str(path), served_model_name=None, transfer_backend="zmq")
    info = embed_register(args, model, "embed-0", "tcp://127.0.0.1:1")
    assert (info.role, info.model, info.layout.head_dim) == ("embed", "tiny-embed", 64)
