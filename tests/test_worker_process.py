"""The role entries in process: worker/process.py (``run_worker``), ``pdserve prefill`` and
``pdserve decode`` (prefill/main.py, decode/main.py), and the coordinator's and gateway's
``run_*``: their flags' defaults and checks, what a worker registers as, and start-up failures
ending in one clear line (``SystemExit``, or a return code), never a traceback or a hang."""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq

from pdserve import envs
from pdserve.coordinator import main as coordinator_main
from pdserve.decode.main import add_decode_args, run_decode
from pdserve.gateway.main import add_gateway_args, run_gateway
from pdserve.kvtransfer.faults import FaultPlan
from pdserve.launch import cli
from pdserve.launch.keygen import keygen
from pdserve.prefill.main import add_prefill_args, run_prefill
from pdserve.protocol import messages as m
from pdserve.protocol.control import Heartbeat, KVLayout, Register
from pdserve.runtime.sockets import bound_address, make_socket, recv_msg
from pdserve.worker import process
from pdserve.worker.process import advertised

HANG_S = 60.0  # only a hang takes this long


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No coordinator, keys or --insecure from the environment, and what a test (or the
    ``export`` of a role command) sets there is undone after it."""
    names = ("PDSERVE_COORDINATOR", "PDSERVE_COORDINATOR_BIND", envs.KEYS, envs.KEY_NAME)
    for name in (*names, envs.INSECURE):
        monkeypatch.setenv(name, "")  # recorded, so the undo restores the variable's absence
        monkeypatch.delenv(name)
    return monkeypatch


def parse(add: Callable[[argparse.ArgumentParser], None], *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(list(argv))


def engine_flags(model: Path) -> list[str]:
    # a small cache and no step-budget calibration: the engine starts in about a second
    return [f"--model={model}", "--num-kv-blocks=64", "--block-size=8", "--max-step-time=0"]


@pytest.fixture
def taken() -> Iterator[str]:
    """A tcp address something else already listens on."""
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.PULL, "tcp://127.0.0.1:0", bind=True)
    try:
        yield bound_address(sock)
    finally:
        sock.close()
        ctx.term()


# ---- flags -----------------------------------------------------------------------------------


def test_worker_flag_defaults(env: pytest.MonkeyPatch) -> None:
    prefill = parse(add_prefill_args)
    assert (
        prefill.coordinator,
        prefill.control_bind,
        prefill.advertise_host,
        prefill.transfer_backend,
        prefill.transfer_timeout,
        prefill.kv_checksum,
        prefill.worker_id,
        prefill.stall_timeout,
        prefill.drain_timeout,
        prefill.served_model_name,
        prefill.kv_fault,
    ) == (None, "tcp://127.0.0.1:0", None, "zmq", 30.0, True, None, 120.0, 30.0, None, None)
    decode = parse(add_decode_args)
    assert (decode.transfer_bind, decode.colocated, decode.kv_failure_policy) == (
        None,
        False,
        "recompute",
    )
    assert parse(add_decode_args, "--no-kv-checksum").kv_checksum is False
    env.setenv("PDSERVE_COORDINATOR", "tcp://10.0.0.5:7000")
    assert parse(add_decode_args).coordinator == "tcp://10.0.0.5:7000"


def test_kv_fault_is_parsed_with_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(add_prefill_args, "--kv-fault=delay:0.5:3").kv_fault == FaultPlan("delay", 0.5, 3)
    assert parse(add_prefill_args, "--kv-fault=corrupt").kv_fault == FaultPlan("corrupt", 1.0, 60)
    for spec, reason in [
        ("bogus", "unknown KV fault 'bogus'; choose one of drop, delay, truncate, corrupt"),
        ("drop:x", "could not convert string to float: 'x'"),
        ("drop:2", "KV fault rate must be in [0, 1], got 2.0"),
    ]:
        with pytest.raises(SystemExit) as e:
            parse(add_prefill_args, f"--kv-fault={spec}")
        assert e.value.code == 2
        error = capsys.readouterr().err.splitlines()[-1]
        assert error.endswith(f"error: argument --kv-fault: {spec!r}: {reason}")


def test_flags_no_worker_runs_with_are_refused_before_the_model_loads(
    env: pytest.MonkeyPatch,
) -> None:
    model = ["--model=/nonexistent/never-read"]
    with pytest.raises(SystemExit) as e:
        run_prefill(parse(add_prefill_args, *model))
    assert str(e.value) == "pdserve prefill: --coordinator (or PDSERVE_COORDINATOR) is required"
    with pytest.raises(SystemExit) as e:
        run_decode(
            parse(add_decode_args, *model, "--coordinator=tcp://127.0.0.1:1", "--stall-timeout=1")
        )
    assert str(e.value) == (
        "pdserve decode: --stall-timeout must be longer than the heartbeat period (1s), got 1"
    )


@pytest.mark.parametrize(
    ("address", "host", "expected"),
    [
        ("tcp://0.0.0.0:5555", "10.1.2.3", "tcp://10.1.2.3:5555"),
        ("tcp://127.0.0.1:5555", None, "tcp://127.0.0.1:5555"),
        ("tcp://[::1]:5555", "node-7", "tcp://node-7:5555"),
        ("ipc:///run/pdserve/w.sock", "10.1.2.3", "ipc:///run/pdserve/w.sock"),
        ("", "10.1.2.3", ""),  # a prefill worker's transfer address
    ],
)
def test_advertised_swaps_the_host_only(address: str, host: str | None, expected: str) -> None:
    assert advertised(address, host) == expected


# ---- start-up failures -------------------------------------------------------------------------


def test_a_model_that_is_not_there_is_one_line(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    coordinator = "--coordinator=tcp://127.0.0.1:1"
    (tmp_path / "empty").mkdir()
    for run, add, model, message in [
        (
            run_prefill,
            add_prefill_args,
            str(tmp_path / "missing"),
            f"pdserve prefill: model directory {tmp_path / 'missing'} does not exist",
        ),
        (
            run_decode,
            add_decode_args,
            "no-such-model",
            "pdserve decode: --model 'no-such-model' is neither a model directory nor a known "
            "model name (smollm2-135m-instruct, all-minilm-l6-v2, tiny, small)",
        ),
        (
            run_prefill,
            add_prefill_args,
            str(tmp_path / "empty"),
            f"pdserve prefill: model directory {tmp_path / 'empty'} has no config.json",
        ),
    ]:
        with pytest.raises(SystemExit) as e:
            run(parse(add, f"--model={model}", coordinator))
        assert str(e.value) == message


def test_addresses_that_cannot_be_used_are_one_line(
    env: pytest.MonkeyPatch, tiny_dir: Path, taken: str
) -> None:
    coordinator = "--coordinator=tcp://127.0.0.1:1"
    flags = engine_flags(tiny_dir)
    with pytest.raises(SystemExit) as e:
        run_prefill(parse(add_prefill_args, *flags, coordinator, f"--control-bind={taken}"))
    assert str(e.value).startswith(
        f"pdserve prefill: cannot bind PULL to {taken}: Address already in use"
    )
    with pytest.raises(SystemExit) as e:
        run_decode(parse(add_decode_args, *flags, coordinator, f"--transfer-bind={taken}"))
    assert str(e.value).startswith(
        f"pdserve decode: cannot bind PULL to {taken}: Address already in use"
    )
    # a malformed coordinator address fails at start-up, not later on the heartbeat thread
    with pytest.raises(SystemExit) as e:
        run_decode(parse(add_decode_args, *flags, "--coordinator=nonsense"))
    assert str(e.value).startswith("pdserve decode: cannot connect PUSH to nonsense: ")


def test_a_failed_start_leaves_no_thread_behind(
    env: pytest.MonkeyPatch, tiny_dir: Path, tmp_path: Path, taken: str
) -> None:
    """With keys, the context runs a ZAP thread: a start that fails after making it stops it."""
    env.setenv(envs.KEYS, str(keygen(tmp_path / "keys", {"w1": frozenset({"prefill"})})))
    env.setenv(envs.KEY_NAME, "w1")
    before = set(threading.enumerate())
    args = parse(add_prefill_args, *engine_flags(tiny_dir), f"--control-bind={taken}")
    args.coordinator = "tcp://127.0.0.1:1"
    with pytest.raises(SystemExit, match="cannot bind PULL"):
        run_prefill(args)
    assert [t for t in threading.enumerate() if t not in before] == []


def test_the_role_commands_refuse_bad_keys(
    env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = keygen(tmp_path / "keys", {"w1": frozenset({"decode"})})
    secret = keys / "w1.key_secret"
    os.chmod(secret, 0o644)
    common = ["--model=/nonexistent/never-read", "--coordinator=tcp://127.0.0.1:1"]
    for argv, message in [
        (
            ["decode", *common, f"--keys={keys}"],
            f"pdserve decode: {secret} is readable by others (mode 644): chmod 600 it",
        ),
        (
            ["prefill", *common, f"--keys={tmp_path / 'none'}"],
            f"pdserve prefill: keys directory {tmp_path / 'none'} does not exist "
            "(make one: pdserve keygen)",
        ),
        (
            ["prefill", *common, f"--keys={keys}", "--insecure"],
            "pdserve prefill: --insecure and --keys exclude each other",
        ),
    ]:
        assert cli.main(argv) == 2
        assert capsys.readouterr().err == message + "\n"


def test_the_coordinator_refuses_bad_bounds(env: pytest.MonkeyPatch) -> None:
    for flag, message in [
        ("--max-gateways=0", "pdserve coordinator: --max-gateways must be at least 1"),
        (
            "--kv-hot-spot-tokens=-1",
            "pdserve coordinator: --kv-hot-spot-tokens must be >= 0 (0: no guard)",
        ),
    ]:
        with pytest.raises(SystemExit) as e:
            coordinator_main.run_coordinator(parse(coordinator_main.add_coordinator_args, flag))
        assert str(e.value) == message


def test_the_gateway_reports_a_port_it_cannot_listen_on(
    env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)  # run_gateway sets the root level: put back after the test
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = parse(add_gateway_args, "--coordinator=tcp://127.0.0.1:1", f"--port={port}")
        assert run_gateway(args) == 1
    assert f"cannot listen on 127.0.0.1:{port}: [Errno 98] Address already in use" in caplog.text


# ---- a worker that starts: what it registers as, and its drain ---------------------------------


class FakeCoordinator:
    """A PULL inbox collecting what workers send; ``stop`` is set once one registered, so
    the worker under test drains and returns. Whatever happens, ``stop`` is set by HANG_S."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.PULL, "tcp://127.0.0.1:0", bind=True)
        self.address = bound_address(self.sock)
        self.got: list[m.Message] = []
        self.stop = threading.Event()
        self.drained = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = threading.Event()
        timer = threading.Timer(HANG_S, deadline.set)
        timer.start()
        try:
            while not deadline.is_set():
                msg = recv_msg(self.sock, timeout_ms=50)
                if msg is None:
                    continue
                self.got.append(msg)
                if isinstance(msg, Register):
                    self.stop.set()
                if isinstance(msg, Heartbeat) and msg.load.draining:
                    self.drained.set()
                    return
        finally:
            timer.cancel()
            timer.join()
            self.stop.set()

    def close(self) -> None:
        self._thread.join(HANG_S)
        self.sock.close()
        self.ctx.term()

    def first(self, kind: type) -> m.Message:
        return next(msg for msg in self.got if isinstance(msg, kind))


@pytest.fixture
def coordinator(env: pytest.MonkeyPatch) -> Iterator[FakeCoordinator]:
    fake = FakeCoordinator()
    env.setattr(process, "stop_on_signals", lambda: fake.stop)  # instead of SIGTERM
    try:
        yield fake
    finally:
        fake.stop.set()
        fake.close()


def test_a_prefill_worker_registers_with_its_defaults(
    coordinator: FakeCoordinator, tiny_dir: Path
) -> None:
    args = parse(add_prefill_args, *engine_flags(tiny_dir), "--max-model-len=512")
    args.coordinator = coordinator.address
    assert run_prefill(args) == 0
    assert coordinator.drained.wait(HANG_S), "no draining heartbeat after the stop"
    reg = coordinator.first(Register)
    assert re.fullmatch(r"prefill-[0-9a-f]{8}", reg.worker_id)
    assert re.fullmatch(r"tcp://127\.0\.0\.1:[1-9][0-9]*", reg.control_address)
    assert (reg.role, reg.model, reg.model_root) == ("prefill", tiny_dir.name, str(tiny_dir))
    assert (reg.transfer_address, reg.transfer_backend) == ("", "zmq")
    assert (reg.num_blocks, reg.max_model_len, reg.tensor_parallel_size) == (64, 512, 1)
    assert reg.layout == KVLayout(
        block_size=8, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16, weights="none"
    )
    last = [msg for msg in coordinator.got if isinstance(msg, Heartbeat)][-1]
    assert (last.worker_id, last.load.draining, last.load.total_blocks) == (reg.worker_id, True, 64)


def test_a_tensor_parallel_group_registers_as_one_worker_of_its_size(
    coordinator: FakeCoordinator, tiny_dir: Path
) -> None:
    """Rank 0 of a group of 2 (its rank 1 started here) registers once, with the group's size:
    what the planner reads its profile at."""
    flags = [*engine_flags(tiny_dir), "--tensor-parallel-size=2", "--threads=1", "--dtype=float32"]
    args = parse(add_prefill_args, *flags)
    args.coordinator = coordinator.address
    assert run_prefill(args) == 0
    assert coordinator.drained.wait(HANG_S), "no draining heartbeat after the stop"
    registered = {msg.worker_id for msg in coordinator.got if isinstance(msg, Register)}
    reg = coordinator.first(Register)
    assert registered == {reg.worker_id}
    assert (reg.role, reg.tensor_parallel_size, reg.num_blocks) == ("prefill", 2, 64)


def test_a_colocated_decode_worker_advertises_its_host(
    coordinator: FakeCoordinator, tiny_dir: Path
) -> None:
    """Through the ``pdserve decode`` command: flags, --insecure, the role's parts."""
    argv = [
        "decode",
        *engine_flags(tiny_dir),
        f"--coordinator={coordinator.address}",
        "--colocated",
        "--advertise-host=10.9.8.7",
        "--worker-id=d-7",
        "--served-model-name=house-model",
        "--insecure",
    ]
    assert cli.main(argv) == 0
    assert coordinator.drained.wait(HANG_S), "no draining heartbeat after the stop"
    reg = coordinator.first(Register)
    assert (reg.role, reg.worker_id, reg.model) == ("both", "d-7", "house-model")
    control = re.fullmatch(r"tcp://10\.9\.8\.7:([1-9][0-9]*)", reg.control_address)
    transfer = re.fullmatch(r"tcp://10\.9\.8\.7:([1-9][0-9]*)", reg.transfer_address)
    assert control and transfer and control.group(1) != transfer.group(1)
    assert os.environ[envs.INSECURE] == "1"  # what every socket of the process read


def test_the_coordinator_writes_its_bound_address(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``run_coordinator`` up to its loop: the flags reach the ``Coordinator``, the bound
    address reaches ``--address-file`` (what ``pdserve serve`` waits on)."""
    made: list[tuple] = []
    served: list[str] = []

    def fake_coordinator(*args: object, **kw: object) -> SimpleNamespace:
        made.append((args[1:], kw))
        return SimpleNamespace(handle=None, tick=None, shared=SimpleNamespace())

    def fake_serve(inbox: zmq.Socket, *args: object, **kw: object) -> None:
        served.append(bound_address(inbox))

    env.setattr(coordinator_main, "Coordinator", fake_coordinator)
    env.setattr(coordinator_main, "serve", fake_serve)
    env.setattr(coordinator_main, "stop_on_signals", threading.Event)
    address_file = tmp_path / "coordinator"
    args = parse(
        coordinator_main.add_coordinator_args,
        f"--address-file={address_file}",
        "--reserve-timeout=7",
        "--routing=load",
        "--max-local-prefill-tokens=64",
    )
    assert coordinator_main.run_coordinator(args) == 0
    assert re.fullmatch(r"tcp://127\.0\.0\.1:[1-9][0-9]*", served[0])
    assert address_file.read_text() == served[0]
    kw_planner = made[0][1]["make_planner"]
    rollouts = made[0][1]["rollouts"]
    assert rollouts.rollouts() == []  # no versions named
    assert kw_planner("tiny").profiles == {}  # no profile shipped for a random model
    assert not Path(f"{address_file}.tmp").exists()
    assert made == [
        (
            (5.0,),
            dict(
                reserve_timeout_s=7.0,
                prefill_timeout_s=120.0,
                queue_timeout_s=60.0,
                max_local_prefill_tokens=64,
                max_prefill_queue_tokens=0,
                routing="load",
                hot_spot_tokens=2048,
                make_planner=kw_planner,
                planner_interval_s=5.0,
                planner_window_s=30.0,
                auto_local=False,  # a figure given: the planner's threshold is not used
                hold_timeout_s=10.0,
                rollouts=rollouts,
                canary_gate=None,
            ),
        )
    ]
