"""Rollouts without processes: the table and its checks, the admin's commands on the wire and
who may send them, the sticky choice's statistics, the canary gate's verdicts, serve's version
flags (tests/test_rollouts_e2e.py runs a cluster)."""

from __future__ import annotations

import argparse
import math

import pytest

from pdserve.coordinator.canary_gate import CanaryGate, Figures, GateConfig, verdict
from pdserve.coordinator.coordinator import Coordinator
from pdserve.coordinator.rollout_args import add_rollout_args, rollouts_from_args
from pdserve.coordinator.rollouts import RolloutError, RolloutTable
from pdserve.gateway.openai_models import ChatCompletionRequest, CompletionRequest
from pdserve.gateway.versions import Versions, choose, conversation_pin, rollout_metrics
from pdserve.launch.children import Child, restart
from pdserve.launch.rollout import parse_weights
from pdserve.launch.versions import mark_expendable, take_versions
from pdserve.protocol import messages as m
from pdserve.protocol.planning import LatencySamples, samples_problem
from pdserve.protocol.roles import ADMIN, Receiver, parse_roles, refusal
from pdserve.protocol.rollouts import Rollout, RolloutAnswer, RolloutCommand, format_rollout
from pdserve.runtime.gate import RoleGate
from pdserve.runtime.security import Security

KNOWN = {"v1", "v2", "v3"}


def table() -> RolloutTable:
    return RolloutTable.from_flags(["chat@v1", "chat@v2", "chat@v3"], ["chat@v2=25%"])


# ---- the table ------------------------------------------------------------------------------


def test_flags_make_the_first_version_stable_with_what_the_canaries_leave() -> None:
    (r,) = table().rollouts()
    assert (r.model, r.stable, r.weights) == ("chat", "v1", {"v1": 75, "v2": 25, "v3": 0})
    assert format_rollout(r) == "chat: v1=75 (stable) v2=25 v3=0 [as started]"
    assert RolloutTable.from_flags(["a@x"], []).rollouts()[0].weights == {"x": 100}


@pytest.mark.parametrize(
    ("models", "canaries", "error"),
    [
        (["chat"], [], "--model 'chat': a version is named NAME@VERSION"),
        (["chat@v1", "chat@v1"], [], "version v1 of chat is given twice"),
        (["chat@v1"], ["chat@v2=5%"], "no --model chat@v2"),
        (["chat@v1", "chat@v2"], ["chat@v1=5%"], "chat@v1 is chat's stable version"),
        (["chat@v1", "chat@v2"], ["chat@v2=5.5%"], "a whole percent"),
        (["chat@v1", "chat@v2"], ["chat@v2"], "write NAME@VERSION=PERCENT"),
        (["c@1", "c@2", "c@3"], ["c@2=60", "c@3=50"], "take over 100%"),
    ],
)
def test_flags_that_cannot_be_served_are_refused(models, canaries, error) -> None:
    with pytest.raises(ValueError, match=error):
        RolloutTable.from_flags(models, canaries)


def test_set_promote_and_rollback_apply_whole() -> None:
    t = table()
    r = t.set_weights("chat", {"v2": 50, "v1": 50}, KNOWN)
    assert (r.stable, r.weights, r.reason) == ("v1", {"v1": 50, "v2": 50, "v3": 0}, "set by admin")
    r = t.promote("chat", "v2", KNOWN)
    assert (r.stable, r.weights) == ("v2", {"v2": 100, "v1": 0, "v3": 0})
    assert r.order() == ["v2", "v1", "v3"]
    t.set_weights("chat", {"v2": 90, "v3": 10}, KNOWN)
    r = t.rollback("chat")
    assert (r.stable, r.weights, r.gate_rollbacks) == ("v2", {"v2": 100, "v1": 0, "v3": 0}, 0)
    r = t.rollback("chat", "canary gate: ...", gate=True)
    assert r.gate_rollbacks == 1 and r.reason == "canary gate: ..."
    fresh = t.set_weights("new", {"b": 100, "a": 0}, {"a", "b"})  # a new name: first is stable
    assert fresh.stable == "b"


@pytest.mark.parametrize(
    ("weights", "error"),
    [
        ({"v1": 60, "v2": 30}, "the weights sum to 90, not 100"),
        ({"v1": 50, "v9": 50}, "chat has no version v9"),
        ({"v1": 101, "v2": -1}, "v1's weight must be 0 to 100"),
        ({"v 1": 100}, "a version is 1 to 64"),
        ({}, "at least one VERSION=PERCENT"),
    ],
)
def test_a_bad_set_changes_nothing(weights, error) -> None:
    t = table()
    before = t.rollouts()
    with pytest.raises(RolloutError, match=error):
        t.set_weights("chat", weights, KNOWN)
    assert t.rollouts() == before
    with pytest.raises(RolloutError, match="no version v9"):
        t.promote("chat", "v9", KNOWN)
    with pytest.raises(RolloutError, match="no versions to roll back"):
        t.rollback("other")


class Outbox:
    def __init__(self) -> None:
        self.to: list[tuple[str, m.Message]] = []

    def to_worker(self, worker_id: str, address: str, msg: m.Message) -> None:
        pass

    def to_gateway(self, address: str, msg: m.Message) -> None:
        self.to.append((address, m.decode(m.encode(msg))))  # as it crosses the wire

    def forget_worker(self, worker_id: str) -> None:
        pass


def coordinator(gate: GateConfig | None = None) -> tuple[Coordinator, Outbox]:
    out = Outbox()
    return Coordinator(out, rollouts=table(), canary_gate=gate), out


def test_the_coordinator_answers_a_command_and_gateways_hear_the_table() -> None:
    c, out = coordinator()
    c.handle(m.GatewayHello("tcp://gw:quiet"), 0.0)
    c.handle(m.GatewayHello("tcp://gw:1"), 10.5)  # the other one is quiet past 10 s: gone
    out.to.clear()
    cmd = RolloutCommand(
        request_id="r1", reply_address="tcp://admin:1", action="set", model="chat",
        weights={"v1": 90, "v2": 10},
    )  # fmt: skip
    c.handle(m.decode(m.encode(cmd)), 11.0)
    # the gateway heard lately gets the new table at once, before the admin's answer goes
    [(pushed_to, pushed), (address, answer)] = out.to
    assert pushed_to == "tcp://gw:1" and isinstance(pushed, m.ClusterState)
    assert [(r.model, r.weights["v2"]) for r in pushed.rollouts] == [("chat", 10)]
    assert address == "tcp://admin:1" and isinstance(answer, RolloutAnswer)
    assert answer.error == "" and answer.rollouts[0].weights == {"v1": 90, "v2": 10, "v3": 0}
    for i in range(100):  # a flood of addresses: a bounded few are pushed to
        c.handle(m.GatewayHello(f"tcp://gw:{i + 2}"), 11.0)
    assert len(c.gateways) == 64 and "tcp://gw:1" in c.gateways
    status = RolloutCommand(request_id="r3", reply_address="tcp://admin:1", action="status")
    out.to.clear()
    c.handle(status, 11.5)
    assert [a for a, _ in out.to] == ["tcp://admin:1"]  # nothing changed: no push
    bad = RolloutCommand(request_id="r2", reply_address="tcp://admin:1", action="promote",
                         model="chat", version="v7")  # fmt: skip
    c.handle(bad, 1.0)
    assert out.to[-1][1] == RolloutAnswer(request_id="r2", error="chat has no version v7 "
                                          "(known: v1, v2, v3)")  # fmt: skip
    c.handle(m.GatewayHello("tcp://gw:1"), 2.0)
    state = out.to[-1][1]
    assert isinstance(state, m.ClusterState)
    assert [(r.model, r.weights["v2"]) for r in state.rollouts] == [("chat", 10)]


# ---- the wire and who may send it ----------------------------------------------------------


def test_a_command_out_of_bounds_is_no_message() -> None:
    good = RolloutCommand(request_id="r", reply_address="tcp://a:1", action="status")
    assert m.decode(m.encode(good)) == good
    frames = m.encode(good)
    import msgpack

    head = msgpack.unpackb(frames[0])
    for field, value in (("weights", {"v1": 101}), ("model", "a b"), ("action", "delete")):
        bad = msgpack.packb({**head, field: value})
        with pytest.raises(m.ProtocolError):
            m.decode([bad])
    with pytest.raises(ValueError, match="stable version"):
        Rollout(model="chat", stable="v9", weights={"v1": 100})


def test_only_an_admin_key_sends_a_rollout_command() -> None:
    gw, worker, admin = frozenset({"gateway"}), frozenset({"prefill", "decode"}), {ADMIN}
    assert refusal(Receiver.COORDINATOR, "rollout_command", frozenset(admin)) is None
    for roles in (gw, worker, frozenset({"coordinator"})):
        why = refusal(Receiver.COORDINATOR, "rollout_command", roles)
        assert why == "only admin keys send rollout_command to the coordinator"
    assert refusal(Receiver.ADMIN, "rollout_answer", frozenset({"coordinator"})) is None
    assert refusal(Receiver.ADMIN, "rollout_answer", frozenset(admin)) is not None
    assert ADMIN not in parse_roles("all") and parse_roles("admin") == frozenset(admin)
    keys = {b"gw": gw, b"admin": frozenset(admin)}
    security = Security("coordinator", b"", b"", b"", b"", frozenset(keys), keys)
    gate = RoleGate(security, Receiver.COORDINATOR)
    cmd = RolloutCommand(request_id="r", reply_address="tcp://a:1", action="rollback", model="c")
    assert not gate.admit(cmd, "gw") and gate.refused["rollout_command"] == 1
    assert gate.admit(cmd, "admin")


def test_latency_samples_carry_bounded_request_counts() -> None:
    assert samples_problem(LatencySamples(model="a", requests=3, errors=3)) is None
    assert (
        samples_problem(LatencySamples(model="a", requests=3, errors=4)) == "4 errors of 3 requests"
    )


# ---- the gateway's choice -------------------------------------------------------------------


def test_the_choice_splits_by_weight_sticks_and_grows_from_the_stable_end() -> None:
    r25 = Rollout(model="chat", stable="v1", weights={"v1": 75, "v2": 25})
    r5 = Rollout(model="chat", stable="v1", weights={"v1": 95, "v2": 5})
    n = 20_000
    picks = [choose(r25, f"conversation {i}".encode()) for i in range(n)]
    canary = picks.count("chat@v2")
    assert abs(canary - n / 4) <= 4 * math.sqrt(n * 0.25 * 0.75)  # 4 sigma: 245
    assert all(choose(r25, f"conversation {i}".encode()) == picks[i] for i in range(100))
    on_5 = [i for i in range(n) if choose(r5, f"conversation {i}".encode()) == "chat@v2"]
    assert on_5 and all(picks[i] == "chat@v2" for i in on_5)  # 5 % -> 25 %: none moves back
    assert {choose(Rollout(model="c", stable="b", weights={"a": 0, "b": 100}), b"x")} == {"c@b"}


def test_a_conversations_turns_share_their_pin() -> None:
    def chat(*turns: str, tenant: str = "acme") -> bytes:
        messages = [{"role": "system", "content": "be brief"}]
        for i, text in enumerate(turns):
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        return conversation_pin(ChatCompletionRequest(model="chat", messages=messages), tenant)

    assert chat("hi") == chat("hi", "hello!", "and then?") == chat("hi", "hey", "more", "ok", "x")
    assert chat("hi") != chat("hello") and chat("hi") != chat("hi", tenant="other")
    long = "a" * 300
    completion = lambda p: conversation_pin(CompletionRequest(model="c", prompt=p), "t")  # noqa: E731
    assert completion(long) == completion(long + " and more") != completion("b" + long)


def test_versions_resolve_names_and_metrics_show_weights() -> None:
    rollouts = [Rollout(model="chat", stable="v1", weights={"v1": 0, "v2": 100}, gate_rollbacks=2)]
    versions = Versions(lambda: rollouts)
    assert versions.pick("chat", lambda: b"x") == "chat@v2"
    assert versions.pick("chat", None) == "chat@v1"  # no conversation: the stable version
    assert versions.pick("other", lambda: b"x") == "other"
    assert versions.declared("chat@v2") and not versions.declared("chat@v9")
    assert versions.names() == {"chat": "chat@v1"}
    text = rollout_metrics(rollouts)
    assert 'pdserve_rollout_weight{model="chat",version="v2"} 100.0' in text
    assert 'pdserve_rollout_rollbacks_total{model="chat"} 2.0' in text
    assert rollout_metrics([]) == ""


# ---- the canary gate -----------------------------------------------------------------------

CONFIG = GateConfig(window_s=10.0, error_margin=0.05, ttft_margin=0.5, min_requests=20)


def test_the_gate_compares_error_rates_once_it_has_enough_requests() -> None:
    stable = Figures(100, 1, ())
    assert verdict(stable, Figures(19, 19, ()), CONFIG) is None  # too few to judge
    assert verdict(stable, Figures(40, 2, ()), CONFIG) is None  # 0.05 - 0.01: within
    why = verdict(stable, Figures(40, 4, ()), CONFIG)
    assert why == (
        "error rate 0.100 (4 of 40 requests) over the stable's 0.010 (1 of 100) by 0.090 > "
        "margin 0.05"
    )


def test_the_gate_compares_ttft_p99s() -> None:
    stable = Figures(30, 0, tuple([0.1] * 29 + [0.2]))
    assert verdict(stable, Figures(30, 0, tuple([0.1] * 29 + [0.29])), CONFIG) is None
    why = verdict(stable, Figures(30, 0, tuple([0.1] * 29 + [0.31])), CONFIG)
    assert why == "TTFT p99 0.310 s (30 requests) over the stable's 0.200 s (30) by more than 50%"
    few = Figures(30, 0, (9.0,) * 5)
    assert verdict(stable, few, CONFIG) is None


def test_the_gate_forgets_what_left_its_window_and_rolls_back_once() -> None:
    c, out = coordinator(CONFIG)
    failing = [LatencySamples(model="chat@v2", requests=15, errors=15),
               LatencySamples(model="chat@v1", requests=30, ttft_s=[0.1] * 30)]  # fmt: skip
    c.handle(m.GatewayHello("tcp://gw:1", failing), 0.0)
    c.tick(0.5)
    assert c.rollouts.table.get("chat").weights["v2"] == 25  # 15 < 20: not yet
    c.handle(m.GatewayHello("tcp://gw:1", failing), 11.0)  # the first 15 left the window
    c.tick(11.5)
    assert c.rollouts.table.get("chat").weights["v2"] == 25
    c.handle(m.GatewayHello("tcp://gw:1", failing), 12.0)
    c.tick(12.5)
    r = c.rollouts.table.get("chat")
    assert (r.weights, r.gate_rollbacks) == ({"v1": 100, "v2": 0, "v3": 0}, 1)
    address, pushed = out.to[-1]  # the gateway hears the rollback at once, not a hello later
    assert address == "tcp://gw:1" and isinstance(pushed, m.ClusterState)
    assert pushed.rollouts[0].weights["v2"] == 0
    assert r.reason.startswith("canary gate: chat@v2 error rate 1.000 (30 of 30 requests)")
    c.tick(13.0)
    assert c.rollouts.table.get("chat").gate_rollbacks == 1
    gate = CanaryGate(CONFIG)
    gate.heard([LatencySamples(model="x@1", requests=5)], 0.0, {"chat@v1"})
    assert gate.figures("x@1", 0.0) == Figures(0, 0, ())  # not watched: not kept


def test_gate_and_canary_flags() -> None:
    parser = argparse.ArgumentParser()
    add_rollout_args(parser)
    args = parser.parse_args(
        ["--model=chat@v1", "--model=chat@v2", "--canary=chat@v2=5%", "--canary-gate",
         "--canary-gate-window=30", "--canary-gate-min-requests=5"]
    )  # fmt: skip
    t, gate = rollouts_from_args(args)
    assert t.rollouts()[0].weights == {"v1": 95, "v2": 5}
    assert gate == GateConfig(window_s=30, min_requests=5)
    with pytest.raises(ValueError, match="window must be > 0"):
        GateConfig(window_s=0)
    assert parse_weights(["v1=75", "v2=25%"]) == {"v1": 75, "v2": 25}
    with pytest.raises(ValueError, match="write VERSION=PERCENT"):
        parse_weights(["v1"])


# ---- serve's versions -----------------------------------------------------------------------


def test_serve_takes_versions_and_starts_a_pool_for_each(tmp_path) -> None:
    from pdserve.launch.serve import add_serve_args
    from pdserve.launch.serve_keys import identities
    from pdserve.launch.worker_commands import worker_commands

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(
        [f"--model=chat@v1={tmp_path}", f"--model=chat@v2.1={tmp_path}", "--threads=1",
         "--canary=chat@v2.1=10%"]
    )  # fmt: skip
    versions = take_versions(args, str)
    assert [v.served for v in versions] == ["chat@v1", "chat@v2.1"] and args.model == []
    cmds = worker_commands(args, "tcp://c:1", "")
    ids = [next(a for a in c if a.startswith("--worker-id=")) for c in cmds]
    assert ids == [
        f"--worker-id={t}-{r}" for t in ("v1", "v2_1") for r in ("prefill-0", "decode-1")
    ]
    assert all("--served-model-name=chat@v2.1" in c for c in cmds[2:])
    assert identities(args)["admin"] == frozenset({ADMIN})
    children = [Child("decode", c) for c in cmds]
    mark_expendable(children, args)
    assert [ch.expendable for ch in children] == [False, False, True, True]
    args = parser.parse_args([f"--model=chat@v1={tmp_path}", "--served-model-name=x"])
    with pytest.raises(ValueError, match="served as NAME@VERSION already"):
        take_versions(args, str)


def test_an_expendable_child_is_restarted_after_a_pause_never_fatal() -> None:
    child = Child("decode", ["false"], expendable=True)
    child.start()
    child.proc.wait()
    for _ in range(8):  # far past --max-restarts 1
        child.paused_until = 0.0
        restart(child, 1)
        child.proc.wait()
    assert child.restarts == 8 and child.paused_until > 0
    before = child.restarts
    restart(child, 1)  # within the pause: not yet
    assert child.restarts == before
