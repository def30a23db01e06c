"""Speculation end to end: ``pdserve serve --speculative ...`` processes, the OpenAI API, the
tokens (and logprobs, stop strings, usage, n choices) of one engine without speculation."""

from __future__ import annotations

import openai
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.protocol.sampling import SamplingParams
from tests.e2e_util import ServedCluster
from tests.engine_util import make_engine
from tests.gateway_util import wait_for

PROMPT = "Serving systems split prefill and decode, and decode and decode"


@pytest.fixture(scope="module", params=["ngram-zmq", "draft-nixl"])
def cluster(request, tiny_dir):
    mode, backend = request.param.split("-")
    flags = [f"--speculative={mode}", "--spec-switch=on", f"--transfer-backend={backend}"]
    if mode == "draft":
        flags.append(f"--draft-model={tiny_dir}")  # drafting for itself: its KV must move
    c = ServedCluster(tiny_dir, "--num-kv-blocks=256", *flags)
    yield c
    c.stop()


def _alone(tiny_dir, params: SamplingParams, n: int = 1) -> list[list[int]]:
    ids = Tokenizer.from_dir(tiny_dir).encode(PROMPT)
    seeds = [None if params.seed is None else params.seed + c for c in range(n)]
    runs = [SamplingParams(**{**vars(params), "seed": s}) for s in seeds]
    return [o.new_token_ids for o in make_engine(tiny_dir).generate([ids] * n, runs)]


def test_text_logprobs_stop_and_choices_equal_one_engine(cluster, tiny_dir) -> None:
    api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0)
    tok = Tokenizer.from_dir(tiny_dir)
    [want] = _alone(tiny_dir, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    out = api.completions.create(
        model=cluster.model_name,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == tok.decode(want)
    assert len(out.choices[0].logprobs.tokens) == 24
    # a stop string ending inside a run of kept drafts: the text and usage as token by token
    text = tok.decode(want)
    stop = text[9:12]
    upto = next(j for j in range(1, 25) if stop in tok.decode(want[:j]))
    cut = api.completions.create(
        model=cluster.model_name,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == upto
    # three seeded sampled choices, each its own seed's (seed + c)
    three = api.completions.create(
        model=cluster.model_name,
        prompt=PROMPT,
        max_tokens=16,
        temperature=1.0,
        top_p=0.9,
        seed=21,
        n=3,
        extra_body={"ignore_eos": True},
    )
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=21, ignore_eos=True)
    texts = [tok.decode(ids) for ids in _alone(tiny_dir, params, n=3)]
    assert [c.text for c in sorted(three.choices, key=lambda c: c.index)] == texts
    assert set(cluster.wait_blocks_free().values()) == {0.0}


def _total(metrics: str, name: str, *labels: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name + "{") and all(label in line for label in labels)
    )


def test_speculation_reaches_metrics(cluster) -> None:
    name = "pdserve_worker_spec_accepted_tokens_total"
    wait_for(lambda: _total(cluster.metrics(), name, 'role="decode"') > 0, timeout=30)
    metrics = cluster.metrics()
    steps = "pdserve_worker_spec_steps_total"
    assert _total(metrics, steps, 'reason="speculated"', 'role="decode"') > 0
    if 'mode="draft"' in metrics:  # prompts' draft KV computed by prefill, moved to decode
        prompt = "pdserve_worker_spec_draft_prompt_tokens_total"
        assert _total(metrics, prompt, 'role="prefill"') > 0
        assert _total(metrics, prompt, 'role="decode"') == 0
        assert prompt + '{role="decode"' in metrics
