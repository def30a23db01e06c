"""Scoring a prompt through ``pdserve serve`` (1 prefill + 1 decode worker) with the openai
client: completions' ``echo`` with ``logprobs`` (and ``max_tokens`` 0, what evaluation
harnesses send), vLLM's ``prompt_logprobs``, streamed and not, and what is refused."""

from __future__ import annotations

import httpx
import openai
import pytest

from pdserve.engine.tokenizer import Tokenizer
from tests.e2e_util import ServedCluster
from tests.test_prompt_logprobs import BOUND, reference

PROMPT = [5, 17, 99, 230, 41, 8, 77, 300, 12, 64, 3, 9, 250, 100, 7, 1, 2, 33]


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    c = ServedCluster(tiny_dir, "--num-kv-blocks=512")
    yield c
    c.stop()


def api(c: ServedCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0)


def post(c: ServedCluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{c.url}{path}", json={"model": c.model_name, **body}, timeout=60)


def test_echo_with_max_tokens_0_scores_the_prompt(cluster, tiny_dir) -> None:
    out = api(cluster).completions.create(
        model=cluster.model_name, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0
    )
    choice = out.choices[0]
    tok = Tokenizer.from_dir(tiny_dir)
    assert choice.text == tok.decode(PROMPT, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(PROMPT), 0)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(tiny_dir, tuple(PROMPT))
    for i, (token, got) in enumerate(zip(PROMPT[1:], lp.token_logprobs[1:], strict=True)):
        assert got is not None and abs(got - ref[i, token].item()) < BOUND
    assert len(lp.tokens or []) == len(PROMPT) and lp.text_offset is not None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # logprobs 1: each position's top holds its own token and the most likely one
    best = ref.argmax(dim=-1).tolist()
    for i, top in enumerate(lp.top_logprobs[1:]):
        assert top is not None and tok.decode([best[i]], skip_special_tokens=False) in top


def test_echo_of_a_prompt_of_one_token(cluster, tiny_dir) -> None:
    """An empty text is its bos alone: listed, scored by nothing, no text."""
    body = {"prompt": "", "echo": True, "logprobs": 0, "max_tokens": 0}
    r = post(cluster, "/v1/completions", body)
    choice = r.json()["choices"][0]
    assert (r.status_code, choice["text"], choice["finish_reason"]) == (200, "", "length")
    bos = Tokenizer.from_dir(tiny_dir).encode("", True)
    assert len(bos) == 1 and choice["logprobs"]["token_logprobs"] == [None]
    assert choice["logprobs"]["text_offset"] == [0]


def test_echo_before_a_generation_streamed_and_not(cluster, tiny_dir) -> None:
    body = {"prompt": "The quick brown fox", "echo": True, "logprobs": 2}
    body |= {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    whole = post(cluster, "/v1/completions", body).json()["choices"][0]
    plain = post(cluster, "/v1/completions", {**body, "echo": False}).json()["choices"][0]
    assert whole["text"] == "The quick brown fox" + plain["text"]
    prompt_len = len(Tokenizer.from_dir(tiny_dir).encode("The quick brown fox", True))
    lp = whole["logprobs"]
    assert lp["tokens"][prompt_len:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][prompt_len:] == plain["logprobs"]["token_logprobs"]
    assert len(lp["tokens"]) == prompt_len + 5
    shift = len("The quick brown fox")
    assert lp["text_offset"][prompt_len:] == [o + shift for o in plain["logprobs"]["text_offset"]]
    with httpx.stream(
        "POST",
        f"{cluster.url}/v1/completions",
        json={"model": cluster.model_name, **body, "stream": True},
        timeout=60,
    ) as r:
        events = [x[6:] for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    chunks = [httpx.Response(200, content=e).json()["choices"][0] for e in events]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]
    offsets = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]


def test_vllm_prompt_logprobs(cluster, tiny_dir) -> None:
    ref = reference(tiny_dir, tuple(PROMPT))
    body = {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 2, "temperature": 0}
    choice = post(cluster, "/v1/completions", body).json()["choices"][0]
    scores = choice["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(PROMPT)
    for i, token in enumerate(PROMPT[1:]):
        entry = scores[i + 1]
        assert abs(entry[str(token)]["logprob"] - ref[i, token].item()) < BOUND
        top2 = ref[i].topk(2).indices.tolist()
        assert {str(t) for t in top2} <= set(entry) and len(entry) in (2, 3)
        assert entry[str(top2[0])]["rank"] == 1
    messages = [{"role": "user", "content": "Hi"}]
    chat = post(cluster, "/v1/chat/completions", {"messages": messages, "prompt_logprobs": 0})
    body = chat.json()
    assert chat.status_code == 200 and body["prompt_logprobs"][0] is None
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "echo": True, "n": 2}, "echo"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 0, "n": 2}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "echo": True},
            "echo",
        ),
    ],
)
def test_refusals(cluster, path, body, param) -> None:
    r = post(cluster, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_lm_eval_scores_the_served_model_as_its_hf_model(cluster, tiny_dir) -> None:
    """lm-evaluation-harness' ``local-completions`` through pdserve and its ``hf`` model on the
    same checkpoint: the same answers, every (question, choice) loglikelihood within the bound."""
    from pdserve.bench.experiments.lm_eval_check import TOLERANCE_PER_TOKEN, check

    f = check(cluster.url, tiny_dir, cluster.model_name, batch_size=8)
    assert (f["served_acc"], f["served_acc_norm"]) == (f["hf_acc"], f["hf_acc_norm"])
    assert f["pairs"] == 80 and f["over_tolerance"] == 0
    assert f["max_diff_per_token"] <= TOLERANCE_PER_TOKEN
    # all 80 pairs went through pdserve, 8 a request, each with exactly lm_eval's tokens
    assert f["requests"] == 10
    assert f["prompt_tokens"] == f["expected_prompt_tokens"] > 0
