"""protocol: every message round-trips; malformed frames raise ProtocolError with a clear
message and nothing else; the runtime's socket helpers move typed messages and drop bad ones."""

from __future__ import annotations

import dataclasses
import logging
import random
import subprocess
import sys

import msgpack
import pytest
import zmq

from pdserve.protocol import messages as m
from pdserve.protocol.codec import registered
from pdserve.protocol.control import (
    MAX_TENSOR_PARALLEL_SIZE,
    Heartbeat,
    KVEvents,
    KVLayout,
    KVRegions,
    Register,
    WorkerLoad,
)
from pdserve.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Accepted,
    ClusterState,
    Finished,
    GatewayHello,
    Generate,
    KVHeader,
    PrefillJob,
    ProtocolError,
    RequestError,
    Reserve,
    Reserved,
    SamplingParams,
    ServedModel,
    Share,
    StructuredSpec,
    Tier,
    TokenBatch,
    TokenChunk,
    TokenLogprob,
    TransferDone,
    WorkerStatus,
    decode,
    encode,
)
from pdserve.protocol.rollouts import RolloutAnswer, RolloutCommand
from pdserve.protocol.transfer import KVAck, KVPeer, KVPeers
from pdserve.runtime import sockets
from pdserve.runtime.loop import PushOutbox

SPEC = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=11, stop_token_ids=[2, 9])
LOGPROB = TokenLogprob(token_id=5, logprob=-0.25, rank=2, top=[(4, -0.125), (5, -0.25)])
LAYOUT = KVLayout(block_size=16, dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=16)
REGIONS = KVRegions(
    agent="pdserve-decode-12-ab",
    metadata=bytes(range(256)) * 2,  # NIXL's own blob: opaque bytes, carried as they are
    mem="DRAM",
    device_id=0,
    layer_addrs=[2**47 + 4096, 2**64 - 2**20],
    block_bytes=2048,
    num_blocks=128,
    layout=LAYOUT,
)
GROUP = Register(  # a tensor-parallel group of 8 ranks: one worker, its rank 0
    role="decode",
    worker_id="g0",
    model="tiny",
    control_address="ipc://g",
    transfer_address="tcp://127.0.0.1:6",
    transfer_backend="zmq",
    layout=LAYOUT,
    num_blocks=128,
    tensor_parallel_size=8,
)
SAMPLES = [
    Register(
        role="both",
        worker_id="w0",
        model="tiny",
        control_address="ipc://c",
        transfer_address="tcp://127.0.0.1:5",
        transfer_backend="zmq",
        layout=LAYOUT,
        num_blocks=128,
    ),
    Heartbeat(
        worker_id="w0",
        load=WorkerLoad(
            free_blocks=100,
            used_blocks=28,
            total_blocks=128,
            running=3,
            waiting=1,
            queued_prompt_tokens=512,
        ),
    ),
    KVEvents(worker_id="w0", epoch="9f2c", seq=4, stored=[2**64 - 1, 7], evicted=[0]),
    KVEvents(worker_id="w0", epoch="9f2c", seq=5, stored=[3], snapshot=True, part=1, parts=2),
    Generate(
        request_id="r1",
        model="tiny",
        prompt_token_ids=[1, 2, 3],
        sampling=SPEC,
        n=2,
        stream_address="ipc://gw",
    ),
    Reserve(
        request_id="r1", prompt_token_ids=[1, 2, 3], sampling=SPEC, n=1, stream_address="ipc://gw"
    ),
    Reserve(  # who it is for: the order it waits in (protocol/tenancy.py)
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling=SPEC,
        n=1,
        stream_address="ipc://gw",
        share=Share(tenant="acme.prod", tier=Tier.PREMIUM, weight=2.5, priority=-7),
    ),
    Reserved(
        request_id="r1",
        worker_id="d0",
        block_ids=[4, 9],
        transfer_address="tcp://127.0.0.1:6",
        choice=1,
    ),
    Reserved(
        request_id="r2",
        worker_id="d0",
        block_ids=[],
        transfer_address="tcp://127.0.0.1:6",
        error="no free blocks",
    ),
    PrefillJob(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling=SPEC,
        n=1,
        dst_block_ids=[4, 9],
        transfer_address="tcp://127.0.0.1:6",
        stream_address="ipc://gw",
    ),
    TransferDone(
        request_id="r1",
        first_token_ids=[42, 43],
        first_logprobs=[LOGPROB, LOGPROB],
        num_cached_tokens=16,
    ),
    TokenBatch(
        [
            TokenChunk(
                request_id="r1",
                choice=0,
                index=1,
                token_ids=[7, 8],
                logprobs=None,
                finished=False,
                finish_reason=None,
                num_prompt_tokens=3,
                num_cached_tokens=0,
            )
        ]
    ),
    TokenBatch(
        [
            TokenChunk(
                request_id="r1",
                choice=1,
                index=3,
                token_ids=[2],
                logprobs=[LOGPROB],
                finished=True,
                finish_reason="stop",
                num_prompt_tokens=3,
                num_cached_tokens=16,
            ),
            TokenChunk(
                request_id="r2",
                choice=0,
                index=5,
                token_ids=[4, 5],
                logprobs=None,
                finished=False,
                finish_reason=None,
                num_prompt_tokens=9,
                num_cached_tokens=0,
            ),
        ]
    ),
    Abort("r1", "client disconnected"),
    RequestError(request_id="r1", status=503, message="no decode worker"),
    Finished("r1", 1, "d0"),
    Accepted("r1", 1),
    GatewayHello("tcp://127.0.0.1:5557"),
    ClusterState(
        models=[ServedModel(name="tiny", root="/models/tiny", max_model_len=2048, ready=True)],
        workers=[
            WorkerStatus(
                role="decode",
                worker_id="d0",
                model="tiny",
                load=WorkerLoad(
                    free_blocks=97,
                    used_blocks=3,
                    total_blocks=100,
                    running=2,
                    waiting=0,
                    queued_prompt_tokens=0,
                    draining=True,
                ),
            )
        ],
    ),
    KVHeader(  # a pull transport's offer: where to read, where it lands, the secret
        request_id="r1#2",
        dst_block_ids=[4, 9],
        src_block_ids=[0, 31],
        num_layers=2,
        dtype="float32",
        block_shape=[2, 16, 2, 16],
        checksum=None,
        secret=b"\x07" * 16,
    ),
    Register(
        role="prefill",
        worker_id="p0",
        model="tiny",
        control_address="ipc://c",
        transfer_address="",
        transfer_backend="nixl",
        layout=LAYOUT,
        num_blocks=128,
        kv_regions=REGIONS,
    ),
    KVPeers(added=[KVPeer(worker_id="d0", regions=REGIONS)], gone=["d1"]),
    KVAck(request_id="r1#0", ok=False, reason="checksum mismatch"),
    GROUP,
    m.Embed(
        request_id="e1",
        model="minilm",
        inputs=[[101, 7592, 102], [101, 102]],
        stream_address="tcp://127.0.0.1:5",
        share=m.Share(tenant="t", tier=m.Tier.STANDARD, weight=1, priority=2),
    ),
    m.EmbedResult(request_id="e1", dim=2, vectors=bytes(range(16)), num_tokens=5),
    RolloutCommand(
        request_id="c1",
        reply_address="tcp://127.0.0.1:6",
        action="set",
        model="chat",
        weights={"v1": 75, "v2": 25},
    ),
    RolloutAnswer(
        request_id="c1",
        rollouts=[m.Rollout(model="chat", stable="v1", weights={"v1": 75, "v2": 25})],
    ),
    KVHeader(
        request_id="r1",
        dst_block_ids=[4, 9],
        num_layers=2,
        dtype="float32",
        block_shape=[2, 16, 2, 16],
        checksum=b"\x01" * 16,
    ),
]


def frame0(**fields: object) -> list[bytes]:
    return [msgpack.packb(fields, use_bin_type=True)]


def abort_frames(**overrides: object) -> list[bytes]:
    fields = {
        "type": "abort",
        "v": PROTOCOL_VERSION,
        "request_id": "r1",
        "reason": "x",
        "choice": None,
    }
    fields.update(overrides)
    return frame0(**{k: v for k, v in fields.items() if v is not ...})


def decode_error(frames: list[bytes]) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    return str(info.value)


# ---- round trips -----------------------------------------------------------------------------


def test_every_registered_message_has_a_sample() -> None:
    assert {type(m).TYPE for m in SAMPLES} == set(registered())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: f"{type(m).__name__}")
def test_round_trip(msg: object) -> None:
    frames = encode(msg)
    assert len(frames) == 1
    back = decode(frames)
    assert type(back) is type(msg)
    assert back == msg


def test_wire_form_is_a_tagged_versioned_map() -> None:
    (frame,) = encode(Abort("r1", "client disconnected"))
    assert msgpack.unpackb(frame) == {
        "type": "abort",
        "v": 14,
        "request_id": "r1",
        "reason": "client disconnected",
        "choice": None,
    }


def test_nested_values_come_back_typed() -> None:
    back = decode(
        encode(TransferDone(request_id="r1", first_token_ids=[1], first_logprobs=[LOGPROB]))
    )
    assert back.first_logprobs[0].top == [(4, -0.125), (5, -0.25)]
    assert type(back.first_logprobs[0].top[0]) is tuple
    spec = decode(
        encode(
            Generate(
                request_id="r",
                model="m",
                prompt_token_ids=[1],
                sampling=SamplingParams(temperature=0),
                n=1,
                stream_address="a",
            )
        )
    ).sampling
    assert spec.temperature == 0.0 and type(spec.temperature) is float


def test_large_bytes_travel_as_extra_frames() -> None:
    payload = bytes(range(256)) * 20  # 5120 bytes, over the out-of-band threshold
    msg = KVHeader(
        request_id="r1",
        dst_block_ids=[1],
        num_layers=1,
        dtype="float32",
        block_shape=[2, 1, 1, 1],
        checksum=payload,
    )
    frames = encode(msg)
    assert len(frames) == 2 and frames[1] == payload
    assert decode(frames) == msg
    assert decode_error([frames[0]]) == "KVHeader.checksum: bad frame reference 1"
    assert decode_error([*frames, b"x"]) == "KVHeader: 1 unreferenced extra frame(s)"


def test_the_engine_uses_the_wire_types() -> None:
    """One type per concept: what the sampler reads and makes is what travels."""
    import typing

    from pdserve.engine.engine import RequestOutput
    from pdserve.engine.scheduler import Sequence

    hints = typing.get_type_hints(Sequence)
    assert hints["params"] is SamplingParams
    assert hints["output_logprobs"] == list[TokenLogprob]
    assert typing.get_type_hints(RequestOutput)["new_logprobs"] == list[TokenLogprob]
    assert typing.get_type_hints(Generate)["sampling"] is SamplingParams
    assert (SPEC.max_tokens, SPEC.top_k, SPEC.stop_token_ids) == (7, 3, [2, 9])


def test_sampling_params_and_logprobs_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SPEC.seed = 12  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        LOGPROB.rank = 1  # type: ignore[misc]
    assert (dataclasses.replace(SPEC, seed=12).seed, SPEC.seed) == (12, 11)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 2.0$"):
        dataclasses.replace(SPEC, top_p=2.0)  # a variant is validated as well


FULL_SPEC = SamplingParams(
    max_tokens=9,
    temperature=0.7,
    top_p=0.9,
    top_k=-1,
    min_p=0.05,
    presence_penalty=-2.0,
    frequency_penalty=2.0,
    repetition_penalty=1.1,
    seed=2**63 - 1,
    stop_token_ids=[2, 9],
    ignore_eos=True,
    min_tokens=9,
    logprobs=20,
    structured=StructuredSpec("regex", "[ab]+"),
)


@pytest.mark.parametrize(
    "spec", [SamplingParams(), SPEC, FULL_SPEC], ids=["default", "spec", "full"]
)
def test_sampling_params_round_trip(spec: SamplingParams) -> None:
    for msg in (
        Generate(
            request_id="r1",
            model="tiny",
            prompt_token_ids=[1],
            sampling=spec,
            n=1,
            stream_address="ipc://gw",
        ),
        Reserve(
            request_id="r1", prompt_token_ids=[1], sampling=spec, n=1, stream_address="ipc://gw"
        ),
        PrefillJob(
            request_id="r1",
            prompt_token_ids=[1],
            sampling=spec,
            n=1,
            dst_block_ids=[4],
            transfer_address="tcp://127.0.0.1:6",
            stream_address="ipc://gw",
        ),
    ):
        back = decode(encode(msg))
        assert back == msg and back.sampling == spec


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sampling__temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"sampling__top_p": 0}, "top_p must be in (0, 1], got 0.0"),
        ({"sampling__top_k": -2}, "top_k must be -1, 0 (off) or positive, got -2"),
        ({"sampling__min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"sampling__presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"sampling__frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3.0"),
        ({"sampling__repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"sampling__max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"sampling__min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"sampling__min_tokens": 8}, "min_tokens (8) must not exceed max_tokens (7)"),
        ({"sampling__logprobs": 21}, "logprobs must be between 0 and 20, got 21"),
        ({"sampling__temperature": float("nan")}, "temperature must be >= 0, got nan"),
    ],
)
def test_out_of_range_sampling_is_refused_by_the_codec(changes: dict, message: str) -> None:
    """A peer's bad values stop at decode, as the codec's own error naming the field."""
    assert decode_error(generate_frames(**changes)) == f"Generate.sampling: {message}"


# ---- rejections ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([], "empty message: no frames"),
        (frame0(type="nope", v=1), "unknown message type 'nope'"),
        (frame0(v=1), "message type must be a str, got NoneType"),
        ([msgpack.packb([1, 2])], "frame 0 must be a map, got list"),
        (abort_frames(v=1), "Abort: protocol version 1, expected 14"),
        (abort_frames(v=6), "Abort: protocol version 6, expected 14"),
        (abort_frames(v=True), "Abort: protocol version True, expected 14"),
        (abort_frames(v=...), "Abort: missing protocol version 'v'"),
        (abort_frames(reason=...), "Abort: missing field 'reason'"),
        (abort_frames(extra=1), "Abort: unexpected field 'extra'"),
        (abort_frames(reason=3), "Abort.reason: expected str, got int"),
        (abort_frames(reason=b"x"), "Abort.reason: expected str, got bytes"),
    ],
)
def test_malformed_envelope(frames: list[bytes], message: str) -> None:
    assert decode_error(frames) == message


def generate_frames(**changes: object) -> list[bytes]:
    (frame,) = encode(
        Generate(
            request_id="r1",
            model="tiny",
            prompt_token_ids=[1, 2, 3],
            sampling=SPEC,
            n=1,
            stream_address="ipc://gw",
        )
    )
    fields = msgpack.unpackb(frame)
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        target = fields
        for p in parents:
            target = target[p]
        if value is ...:
            del target[leaf]
        else:
            target[leaf] = value
    return [msgpack.packb(fields, use_bin_type=True)]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"n": True}, "Generate.n: expected int, got bool"),
        ({"n": 1.0}, "Generate.n: expected int, got float"),
        ({"prompt_token_ids": "abc"}, "Generate.prompt_token_ids: expected list[int], got str"),
        ({"prompt_token_ids": [1, "2"]}, "Generate.prompt_token_ids[1]: expected int, got str"),
        ({"sampling": [1]}, "Generate.sampling: expected SamplingParams, got list"),
        (
            {"sampling__temperature": "hot"},
            "Generate.sampling.temperature: expected float, got str",
        ),
        ({"sampling__seed": ...}, "Generate.sampling: missing field 'seed'"),
        ({"sampling__beam": 2}, "Generate.sampling: unexpected field 'beam'"),
        ({"sampling__seed": "7"}, "Generate.sampling.seed: expected int, got str"),
        ({"sampling__ignore_eos": 0}, "Generate.sampling.ignore_eos: expected bool, got int"),
        (
            {"sampling__stop_token_ids": [None]},
            "Generate.sampling.stop_token_ids[0]: expected int, got NoneType",
        ),
    ],
)
def test_wrong_field_types(changes: dict, message: str) -> None:
    assert decode_error(generate_frames(**changes)) == message


def test_optional_literal_tuple_and_bytes_fields() -> None:
    (frame,) = encode(SAMPLES[0])
    bad_role = {**msgpack.unpackb(frame), "role": "train"}
    assert (
        decode_error([msgpack.packb(bad_role)])
        == "Register.role: expected one of ['prefill', 'decode', 'both', 'embed'], got 'train'"
    )
    (frame,) = encode(TransferDone(request_id="r1", first_token_ids=[1], first_logprobs=[LOGPROB]))
    fields = msgpack.unpackb(frame)
    fields["first_logprobs"][0]["top"] = [[4, -0.1, 9]]
    assert (
        decode_error([msgpack.packb(fields)])
        == "TransferDone.first_logprobs[0].top[0]: expected tuple[int, float], got list"
    )
    (frame,) = encode(next(x for x in SAMPLES if isinstance(x, KVHeader)))
    fields = {**msgpack.unpackb(frame), "checksum": "abc"}
    assert decode_error([msgpack.packb(fields)]) == "KVHeader.checksum: expected bytes, got str"
    fields["checksum"] = None
    assert decode([msgpack.packb(fields)]).checksum is None


def test_a_registers_tensor_parallel_size_is_an_int_the_coordinator_bounds() -> None:
    """Typed by the codec; bounded, as the worker's other figures, by the coordinator
    (``register_problem``): a group of 1 to ``MAX_TENSOR_PARALLEL_SIZE`` ranks."""
    from pdserve.coordinator.registry import register_problem

    (frame,) = encode(GROUP)
    fields = msgpack.unpackb(frame)
    assert fields["tensor_parallel_size"] == 8
    assert msgpack.unpackb(encode(SAMPLES[0])[0])["tensor_parallel_size"] == 1  # the default
    for value, got in ((True, "bool"), ("8", "str"), (8.0, "float"), (None, "NoneType")):
        expected = f"Register.tensor_parallel_size: expected int, got {got}"
        assert decode_error([msgpack.packb({**fields, "tensor_parallel_size": value})]) == expected
    del fields["tensor_parallel_size"]
    assert decode_error([msgpack.packb(fields)]) == "Register: missing field 'tensor_parallel_size'"
    assert MAX_TENSOR_PARALLEL_SIZE == 1024 and register_problem(GROUP) is None
    assert register_problem(dataclasses.replace(GROUP, tensor_parallel_size=1024)) is None
    for size in (0, -1, 1025):
        assert register_problem(dataclasses.replace(GROUP, tensor_parallel_size=size)) == (
            f"tensor_parallel_size={size} is outside [1, 1024]"
        )


def test_a_workers_load_is_checked_figure_by_figure() -> None:
    """``WorkerLoad`` travels nested in ``Heartbeat`` (and ``WorkerStatus``): each figure is
    checked as a field of its own, and the flat figures of protocol 4 are refused."""
    (frame,) = encode(SAMPLES[1])
    fields = msgpack.unpackb(frame)
    assert fields["load"]["queued_prompt_tokens"] == 512 and fields["load"]["draining"] is False
    fields["load"]["running"] = 1.5
    expected = "Heartbeat.load.running: expected int, got float"
    assert decode_error([msgpack.packb(fields)]) == expected
    del fields["load"]["running"]
    assert decode_error([msgpack.packb(fields)]) == "Heartbeat.load: missing field 'running'"
    flat = {"type": "heartbeat", "v": PROTOCOL_VERSION, "worker_id": "w0", "free_blocks": 1}
    assert decode_error([msgpack.packb(flat)]) == "Heartbeat: missing field 'load'"


def test_bad_frame_references_and_extensions() -> None:
    (frame,) = encode(SAMPLES[-1])
    fields = msgpack.unpackb(frame)
    fields["checksum"] = msgpack.ExtType(1, (5).to_bytes(4, "little"))
    assert decode_error([msgpack.packb(fields), b"x"]) == "KVHeader.checksum: bad frame reference 5"
    fields["checksum"] = msgpack.ExtType(7, b"")
    assert decode_error([msgpack.packb(fields)]) == "unknown msgpack extension 7 (0 bytes)"
    fields["checksum"] = b"ok"
    fields["num_layers"] = msgpack.ExtType(1, (1).to_bytes(4, "little"))
    assert (
        decode_error([msgpack.packb(fields), b"x"])
        == "KVHeader.num_layers: expected int, got frame reference"
    )


def test_a_mistyped_message_is_refused_by_its_receiver() -> None:
    """encode trusts the sender's types (raw msgpack speed); decode checks them."""
    with pytest.raises(ProtocolError, match=r"^Abort.reason: expected str, got int$"):
        decode(encode(Abort("r1", 3)))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match=r"cannot encode"):
        encode(Abort("r1", object()))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match=r"^SamplingParams is not a registered message$"):
        encode(SPEC)  # type: ignore[arg-type]


def test_fuzz_bytes_only_protocol_errors() -> None:
    rng = random.Random(1234)
    valid = [encode(m)[0] for m in SAMPLES]
    outcomes = {"ok": 0, "rejected": 0}
    for i in range(4000):
        if i % 2:
            raw = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        else:  # a valid message with a few bytes flipped, and sometimes cut short
            raw = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.getrandbits(8)
            raw = bytes(raw[: rng.randint(0, len(raw))]) if i % 3 == 0 else bytes(raw)
        frames = [raw] + [b"\x00" * rng.randint(0, 8) for _ in range(rng.randint(0, 2))]
        try:
            decode(frames)  # anything but ProtocolError fails the test
            outcomes["ok"] += 1
        except ProtocolError:
            outcomes["rejected"] += 1
    assert outcomes["ok"] > 0 and outcomes["rejected"] > 3000


def test_fuzz_values_only_protocol_errors() -> None:
    rng = random.Random(99)
    values = [None, 0, -1, 2**63, 1.5, True, "s", b"b", [], {}, [1, "a"], {"k": 1}, [[1, 2.0]]]
    rejected = 0
    for _ in range(3000):
        fields = msgpack.unpackb(encode(rng.choice(SAMPLES))[0])
        target = fields
        while True:  # walk down to a random leaf and replace it
            key = rng.choice(list(target)) if isinstance(target, dict) and target else None
            if key is None or not isinstance(target[key], dict) or rng.random() < 0.3:
                break
            target = target[key]
        if key is not None:
            target[key] = rng.choice(values)
        try:
            msg = decode([msgpack.packb(fields, use_bin_type=True)])
            assert fields["type"] == type(msg).TYPE
        except ProtocolError:
            rejected += 1
    assert rejected > 2000


def test_protocol_runtime_and_kvtransfer_base_import_no_torch() -> None:
    code = (
        "import sys, pdserve.protocol.messages, pdserve.protocol.codec, pdserve.protocol.blocks, "
        "pdserve.protocol.control, pdserve.protocol.checks, "
        "pdserve.protocol.prefix, pdserve.protocol.keys, pdserve.runtime.sockets, "
        "pdserve.runtime.loop, pdserve.runtime.security, pdserve.runtime.liveness, "
        "pdserve.kvtransfer.base; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- sockets ---------------------------------------------------------------------------------


def test_addresses(tmp_path) -> None:
    assert sockets.ipc_address(tmp_path, "gw-ab12") == f"ipc://{tmp_path}/gw-ab12.sock"
    assert sockets.tcp_address("127.0.0.1", 5555) == "tcp://127.0.0.1:5555"
    assert sockets.tcp_address("::1", 5555) == "tcp://[::1]:5555"
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        sockets.ipc_address(tmp_path / ("d" * 120), "x")
    with pytest.raises(ValueError, match=r"port must be in \[0, 65535\], got 70000"):
        sockets.tcp_address("127.0.0.1", 70000)
    assert len(sockets.new_run_id()) == 8 and sockets.new_run_id() != sockets.new_run_id()
    assert 0 < sockets.free_port() < 65536


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_send_recv_over_ipc(tmp_path, zctx, caplog) -> None:
    address = sockets.ipc_address(tmp_path, f"coord-{sockets.new_run_id()}")
    pull = sockets.make_socket(zctx, zmq.PULL, address, bind=True)
    push = sockets.make_socket(zctx, zmq.PUSH, address, bind=False)
    assert sockets.recv_msg(pull, timeout_ms=10) is None
    sockets.send_msg(push, SAMPLES[1])
    assert sockets.recv_msg(pull, timeout_ms=60_000) == SAMPLES[1]
    push.send_multipart([b"\x92\x01\x02"])
    with caplog.at_level(logging.WARNING):
        assert sockets.recv_msg(pull, timeout_ms=60_000) is None
    assert "frame 0 must be a map, got list" in caplog.text
    sockets.send_msg(push, SAMPLES[2])
    assert sockets.recv_msg(pull, timeout_ms=60_000) == SAMPLES[2]


def test_router_dealer_and_bound_port(zctx) -> None:
    router = sockets.make_socket(zctx, zmq.ROUTER, "tcp://127.0.0.1:0", bind=True)
    address = sockets.bound_address(router)
    assert address.startswith("tcp://127.0.0.1:") and not address.endswith(":0")
    dealer = sockets.make_socket(zctx, zmq.DEALER, address, bind=False)
    sockets.send_msg(dealer, SAMPLES[10])
    identity, msg = sockets.recv_routed(router, timeout_ms=60_000)
    assert msg == SAMPLES[10]
    sockets.send_msg(router, SAMPLES[11], identity=identity)
    assert sockets.recv_msg(dealer, timeout_ms=60_000) == SAMPLES[11]
    with pytest.raises(OSError, match=r"^cannot bind PULL to tcp://256.0.0.1:1: "):
        sockets.make_socket(zctx, zmq.PULL, "tcp://256.0.0.1:1", bind=True)


def test_push_outbox_loses_nothing_to_a_receiver_that_falls_behind(zctx, caplog) -> None:
    """A gateway busy for a moment must not lose tokens: a gap hangs its stream forever."""
    pull = sockets.make_socket(zctx, zmq.PULL, "tcp://127.0.0.1:0", bind=True)
    address = sockets.bound_address(pull)
    outbox = PushOutbox(zctx)
    # beyond zmq's default high-water marks (1,000 messages each side) and the kernel's
    # socket buffers (~5 KB a message, 15 MB in all)
    count, ids = 3000, [100_000] * 1000
    with caplog.at_level(logging.WARNING):
        for i in range(count):
            chunk = TokenChunk(
                request_id="r",
                choice=0,
                index=i,
                token_ids=ids,
                logprobs=None,
                finished=False,
                finish_reason=None,
                num_prompt_tokens=3,
                num_cached_tokens=0,
            )
            outbox.to_gateway(address, TokenBatch([chunk]))
    indices = []
    while len(indices) < count:
        msg = sockets.recv_msg(pull, timeout_ms=60_000)
        assert msg is not None, f"only {len(indices)} of {count} arrived"
        indices.append(msg.chunks[0].index)
    assert indices == list(range(count))
    assert "dropped" not in caplog.text
    outbox.close()


def test_embed_messages_are_bounded() -> None:
    """An embed request has 1 to 2,048 non-empty inputs; a result whole rows of floats: a
    peer's other values are a ``ProtocolError`` on decode."""
    with pytest.raises(ValueError, match="1 to 2048 inputs"):
        m.Embed(request_id="e", model="x", inputs=[], stream_address="")
    with pytest.raises(ValueError, match="no tokens"):
        m.Embed(request_id="e", model="x", inputs=[[1], []], stream_address="")
    with pytest.raises(ValueError, match="no whole rows"):
        m.EmbedResult(request_id="e", dim=3, vectors=b"\0" * 16, num_tokens=1)
    (frame,) = encode(m.Embed(request_id="e", model="x", inputs=[[1]], stream_address=""))
    fields = {**msgpack.unpackb(frame), "inputs": [[1]] * 2049}
    assert "1 to 2048 inputs" in decode_error([msgpack.packb(fields)])
