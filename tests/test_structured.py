"""Constrained outputs in the engine and across the prefill/decode split (in-process cluster):
every output that ends with "stop" satisfies its constraint, whatever the (random) weights;
token 0 sampled on the prefill side, the decode side's matcher resumes after it; recompute,
migration and preemption replay the tokens so far."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest

from pdserve.engine.grammar import GrammarCache, grammar_text
from pdserve.engine.tokenizer import Tokenizer
from pdserve.kvtransfer.faults import FaultPlan
from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams
from tests.cluster_util import Cluster
from tests.engine_util import make_engine
from tests.test_worker_death import kill_while_decoding, resume

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "name": {"type": "string", "maxLength": 8},
    },
    "required": ["ok", "color", "n", "name"],
    "additionalProperties": False,
}
JSON_SPEC = m.StructuredSpec("json", json.dumps(SCHEMA))
# long enough to be cut mid-way by a dead worker: 24 enum items
LIST_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"enum": ["ab", "cd", "ef"]},
            "minItems": 24,
            "maxItems": 24,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
LIST_SPEC = m.StructuredSpec("json", json.dumps(LIST_SCHEMA))


def check_json(text: str, schema: dict) -> None:
    jsonschema_rs.validate(schema, json.loads(text))


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return make_engine(tiny_dir)


def run(engine, tok: Tokenizer, spec: m.StructuredSpec, seeds: range, max_tokens: int = 120):
    prompt = tok.encode("a prompt of a few words")
    params = [
        SamplingParams(
            max_tokens=max_tokens, temperature=0.0 if s == 0 else 1.0, seed=s, structured=spec
        )
        for s in seeds
    ]
    outs = engine.generate([prompt] * len(params), params)
    return [(o.finish_reason, tok.decode(o.new_token_ids)) for o in outs]


def test_json_schema_outputs_validate(engine, tok) -> None:
    results = run(engine, tok, JSON_SPEC, range(8))
    assert [reason for reason, _ in results] == ["stop"] * 8
    for _, text in results:
        check_json(text, SCHEMA)
    assert len({text for _, text in results}) > 1  # sampling still samples


@pytest.mark.parametrize(
    ("kind", "spec", "check"),
    [
        ("regex", r"[a-z]{3,6}-[0-9]{2}", lambda t: re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", t)),
        (
            "choice",
            json.dumps(["alpha", "beta", "gamma delta"]),
            lambda t: t in {"alpha", "beta", "gamma delta"},
        ),
        (
            "grammar",
            'root ::= "yes" | "no" | "maybe " [0-9]',
            lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t),
        ),
        ("grammar", 'start: "x" NUM\nNUM: /[0-9]{2}/', lambda t: re.fullmatch(r"x[0-9]{2}", t)),
    ],
)
def test_regex_choice_and_grammar(engine, tok, kind: str, spec: str, check) -> None:
    results = run(engine, tok, m.StructuredSpec(kind, spec), range(6), max_tokens=40)
    for reason, text in results:
        assert reason == "stop" and check(text), (reason, text)


def test_json_object_and_unconstrained_neighbours(engine, tok) -> None:
    """A constrained row next to free ones: only it is masked."""
    prompt = tok.encode("x")
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    obj = SamplingParams(
        max_tokens=200, temperature=1.0, seed=3, structured=m.StructuredSpec("json", "{}")
    )
    alone = engine.generate([prompt], [free])[0].new_token_ids
    mixed = engine.generate([prompt, prompt], [free, obj])
    assert mixed[0].new_token_ids == alone
    if mixed[1].finish_reason == "stop":
        json.loads(tok.decode(mixed[1].new_token_ids))


def test_grammar_compiled_once_per_spec(tiny_dir, tok) -> None:
    engine = make_engine(tiny_dir)
    run(engine, tok, JSON_SPEC, range(3))
    run(engine, tok, JSON_SPEC, range(3, 5))
    assert engine.requests.grammars.compiles == 1
    run(engine, tok, LIST_SPEC, range(1))
    assert engine.requests.grammars.compiles == 2


def test_bad_constraints_are_refused_with_a_reason(tok) -> None:
    cache = GrammarCache(tok.to_json(), tok.vocab_size, tok.eos_token_ids)
    for spec, words in [
        (m.StructuredSpec("json", "{not json"), "not valid JSON"),
        (m.StructuredSpec("regex", "(unclosed"), "invalid regex"),
        (m.StructuredSpec("choice", "[]"), "non-empty list"),
        (m.StructuredSpec("grammar", "root ::= ("), "grammar"),
        (m.StructuredSpec("json", "x" * 70_000), "longer than"),
    ]:
        with pytest.raises(ValueError, match=words):
            grammar_text(spec)
        with pytest.raises(ValueError):
            cache.matcher(spec)


def test_continuation_replays_tokens_through_the_matcher(tiny_dir, tok) -> None:
    engine = make_engine(tiny_dir)
    prompt = tok.encode("resume me")
    params = SamplingParams(max_tokens=120, temperature=0.0, structured=LIST_SPEC)
    whole = engine.generate([prompt], params)[0].new_token_ids
    engine.handoff.add_continuation("r", prompt, whole[:10], params)
    rest = []
    while engine.has_unfinished():
        for out in engine.step():
            rest += out.new_token_ids
    assert whole[:10] + rest == whole
    check_json(tok.decode(whole), LIST_SCHEMA)
    # tokens the constraint forbids are refused, and nothing is left allocated
    bad = tok.encode("not json at all", add_special_tokens=False)
    with pytest.raises(ValueError, match="does not satisfy the output constraint"):
        engine.handoff.add_continuation("bad", prompt, bad, params)
    assert engine.block_manager.num_used_blocks == 0


def test_preemption_keeps_the_constraint(tiny_dir, tok) -> None:
    prompt = tok.encode("some prompt to preempt")
    params = [
        SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured=LIST_SPEC)
        for s in range(4)
    ]
    roomy = make_engine(tiny_dir).generate([prompt] * 4, params)
    tight = make_engine(tiny_dir, num_blocks=40)  # 4 x ~80 tokens do not fit in 160 slots
    preempted: list[str] = []
    preempt = tight.scheduler._preempt
    tight.scheduler._preempt = lambda seq, batch: (
        preempted.append(seq.request_id),
        preempt(seq, batch),
    )
    outs = tight.generate([prompt] * 4, params)
    assert preempted
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in roomy]
    for o in outs:
        assert o.finish_reason == "stop"
        check_json(tok.decode(o.new_token_ids), LIST_SCHEMA)


# ---- across the split ------------------------------------------------------------------------


def spec_of(**kw) -> m.SamplingParams:
    return m.SamplingParams(**{"max_tokens": 120, "temperature": 0.0, **kw})


def cluster_tokens(cluster: Cluster, rid: str, prompt, spec, n: int = 1):
    cluster.submit(rid, prompt, spec, n=n)
    cluster.pump()
    assert cluster.errors() == []
    return cluster.tokens(rid)


def test_disaggregated_equals_colocated_and_single_engine(tiny_dir, tok) -> None:
    prompt = tok.encode("split me")
    disagg = Cluster([make_engine(tiny_dir)], [make_engine(tiny_dir)])
    coloc = Cluster([], [make_engine(tiny_dir)], colocated=True)
    try:
        for i, spec in enumerate((spec_of(structured=JSON_SPEC), spec_of(structured=LIST_SPEC))):
            single = make_engine(tiny_dir).generate(
                [prompt],
                SamplingParams(max_tokens=120, temperature=0.0, structured=spec.structured),
            )[0]
            a = cluster_tokens(disagg, f"d{i}", prompt, spec)
            b = cluster_tokens(coloc, f"c{i}", prompt, spec)
            assert a == b == {0: single.new_token_ids}
            check_json(tok.decode(a[0]), json.loads(spec.structured.spec))
        # n choices, seeded: each has its own matcher and its own draws
        sampled = spec_of(structured=JSON_SPEC, temperature=1.0, seed=7)
        a = cluster_tokens(disagg, "n", prompt, sampled, n=3)
        b = cluster_tokens(coloc, "n", prompt, sampled, n=3)
        assert a == b and len({tuple(t) for t in a.values()}) > 1
        for tokens in a.values():
            check_json(tok.decode(tokens), SCHEMA)
        assert set(disagg.used_blocks().values()) == set(coloc.used_blocks().values()) == {0}
    finally:
        disagg.close()
        coloc.close()


@pytest.mark.parametrize("mode", ["drop", "corrupt"])
def test_transfer_fault_recompute_still_validates(tiny_dir, tok, mode: str) -> None:
    prompt = tok.encode("fault me")
    cluster = Cluster(
        [make_engine(tiny_dir)],
        [make_engine(tiny_dir)],
        fault=FaultPlan(mode),
        policy="recompute",
        transfer_timeout_s=0.5,
    )
    try:
        got = cluster_tokens(cluster, "r", prompt, spec_of(structured=LIST_SPEC))
        single = make_engine(tiny_dir).generate(
            [prompt], SamplingParams(max_tokens=120, temperature=0.0, structured=LIST_SPEC)
        )[0]
        assert got == {0: single.new_token_ids}
        check_json(tok.decode(got[0]), LIST_SCHEMA)
        assert set(cluster.used_blocks().values()) == {0}
    finally:
        cluster.close()


def test_migration_after_decode_death_still_validates(tiny_dir, tok) -> None:
    prompt = tok.encode("migrate me")
    spec = spec_of(structured=LIST_SPEC)
    cluster = Cluster([make_engine(tiny_dir)], [make_engine(tiny_dir), make_engine(tiny_dir)])
    try:
        cluster.submit("r", prompt, spec)
        so_far = kill_while_decoding(cluster, rounds=5)
        assert 0 < len(so_far) < 40
        whole = so_far + resume(cluster, "r", prompt, spec, so_far)
        check_json(tok.decode(whole), LIST_SCHEMA)
        single = make_engine(tiny_dir).generate(
            [prompt], SamplingParams(max_tokens=120, temperature=0.0, structured=LIST_SPEC)
        )[0]
        assert whole == single.new_token_ids
        assert set(cluster.used_blocks().values()) == {0}
    finally:
        cluster.close()
