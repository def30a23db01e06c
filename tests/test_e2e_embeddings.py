"""``/v1/embeddings`` through ``pdserve serve`` with a chat model and the packaged MiniLM behind
one endpoint (``--model`` twice): each routed by name, the embeddings equal
sentence-transformers' on the same directory, an embedding request touches no chat worker, and
bad inputs get OpenAI error bodies."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.e2e_util import ServedCluster
from tests.gateway_util import parse_prometheus, wait_until

TEXTS = [
    "A man is eating food.",
    "The new movie is awesome!",
    "Two dogs play in the snow, chasing a red ball across the yard.",
    "short",
]


@pytest.fixture(scope="module")
def cluster(tiny_dir, embed_dir):
    c = ServedCluster(tiny_dir, f"--model={embed_dir}", "--num-kv-blocks=256")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(embed_dir) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embed_dir), device="cpu").encode(TEXTS)


def api(c: ServedCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0)


def post(c: ServedCluster, body: dict, path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(f"{c.url}{path}", json=body, timeout=60)


def cosine_gap(a: np.ndarray, b: np.ndarray) -> float:
    cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    return float((1 - cos).max())


def worker_tokens(c: ServedCluster) -> dict[str, float]:
    _, samples = parse_prometheus(c.metrics())["pdserve_worker_prefill_tokens_total"]
    return {dict(labels)["worker"]: value for (_, labels), value in samples.items()}


def test_both_models_are_listed_and_each_serves_its_own_api(cluster, embed_dir) -> None:
    # healthy once a model is served: the other's worker may still be loading
    both = {cluster.model_name, embed_dir.name}
    wait_until(lambda: {m.id for m in api(cluster).models.list()} == both, 60, "both models")
    out = api(cluster).completions.create(model=cluster.model_name, prompt="Hi", max_tokens=2)
    assert out.usage is not None and out.usage.completion_tokens == 2
    chat_on_embed = {"model": embed_dir.name, "messages": [{"role": "user", "content": "x"}]}
    r = post(cluster, chat_on_embed, "/v1/chat/completions")
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
    r = post(cluster, {"model": cluster.model_name, "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_embeddings_equal_sentence_transformers(cluster, embed_dir, reference) -> None:
    before = worker_tokens(cluster)
    out = api(cluster).embeddings.create(model=embed_dir.name, input=TEXTS)  # base64 asked
    got = np.array([d.embedding for d in out.data])
    assert [d.index for d in out.data] == [0, 1, 2, 3]
    assert got.shape == (4, 384)
    assert cosine_gap(got, reference) < 1e-4
    assert np.abs(got - reference).max() < 1e-5  # the same float32 math, summed in order
    assert out.usage.prompt_tokens == out.usage.total_tokens > len(TEXTS) * 2
    body = {"model": embed_dir.name, "input": TEXTS, "encoding_format": "float"}
    floats = np.array([d["embedding"] for d in post(cluster, body).json()["data"]])
    assert np.array_equal(floats.astype(np.float32), got.astype(np.float32))
    body["encoding_format"] = "base64"
    raw = post(cluster, body).json()["data"][1]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(raw), "<f4"), got[1].astype(np.float32))
    one = api(cluster).embeddings.create(model=embed_dir.name, input=TEXTS[2])  # alone
    assert np.array_equal(np.array(one.data[0].embedding), got[2])  # as in its batch
    # token ids as input: the same vector as the text they encode
    ids = post(cluster, {"model": embed_dir.name, "input": TEXTS[3]}).json()["usage"]
    assert ids["prompt_tokens"] == 3  # [CLS] short [SEP]
    # the workers' counts reach /metrics with their next heartbeat
    wait_until(lambda: worker_tokens(cluster)["embed-0"] > before["embed-0"], 30, "embed-0 counts")
    after = worker_tokens(cluster)
    assert (after["prefill-0"], after["decode-1"]) == (before["prefill-0"], before["decode-1"])


def tenant_prompt_tokens(c: ServedCluster, model: str) -> float:
    _, samples = parse_prometheus(c.metrics())["pdserve_tenant_tokens_total"]
    return sum(
        value
        for (_, labels), value in samples.items()
        if ("model", model) in labels and ("kind", "prompt") in labels
    )


def test_tenants_are_metered_by_the_inputs_tokens(cluster, embed_dir) -> None:
    before = tenant_prompt_tokens(cluster, embed_dir.name)
    out = api(cluster).embeddings.create(model=embed_dir.name, input=TEXTS[:3])
    assert tenant_prompt_tokens(cluster, embed_dir.name) == before + out.usage.prompt_tokens


def test_token_id_inputs(cluster, embed_dir, reference) -> None:
    from pdserve.engine.embed.tokenize import EmbedTokenizer

    tok = EmbedTokenizer.from_dir(embed_dir, 256, do_lower_case=False)
    ids = tok.encode(TEXTS[:2])
    body = {"model": embed_dir.name, "input": ids, "encoding_format": "float"}
    got = np.array([d["embedding"] for d in post(cluster, body).json()["data"]])
    assert cosine_gap(got, reference[:2]) < 1e-4
    single = {**body, "input": ids[0]}
    assert post(cluster, single).json()["data"][0]["embedding"] == got[0].tolist()


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"input": ""}, 400, "input", None),
        ({"input": []}, 400, "input", None),
        ({"input": ["ok", ""]}, 400, "input", None),
        ({"input": "x", "dimensions": 128}, 400, "dimensions", None),
        ({"input": "word " * 300}, 400, "input", "context_length_exceeded"),
        ({"input": [[101] * 257]}, 400, "input", "context_length_exceeded"),
        ({"input": [[101, 999999]]}, 400, "input", None),
        ({"input": ["x"] * 2049}, 400, "input", None),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format", None),
        ({"input": "x", "model": "nope"}, 404, "model", "model_not_found"),
    ],
)
def test_bad_inputs(cluster, embed_dir, body, status, param, code) -> None:
    r = post(cluster, {"model": embed_dir.name, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
