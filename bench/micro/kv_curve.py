"""KV transfer throughput between two processes: zmq plain, zmq with CURVE, and NIXL.

    .venv/bin/python bench/micro/kv_curve.py [--rounds 5] [--round-mib 512] [--checksum]
        [--transports zmq zmq+curve nixl] [--out FILE.json]

The senders run here, one receiver process per transport (spawn); host memory, one host::

    sender ── zmq: PUSH → PULL over loopback TCP ───▶ receiver process (its own cache)
           ◀── nixl: the receiver reads (pull) over UCX shared memory / CMA (UCX_TLS sm,cma,tcp
               unless the environment sets it)
           ◀─▶ pipe: JSON control; NIXL regions as a protocol KVPeers message

8 layers of 64 KiB blocks ([n, 2, 16, 8, 64] float32); transfers of 1, 16 and 256 MiB (2, 32,
512 blocks, every layer). A round: the receiver expects N = max(2, round-mib / size) transfers
and returns their secrets; the sender sends them back to back; MB/s (1e6 bytes) = bytes /
(first send → the receiver reports the last DONE), the zmq sender's gather and the pipe
included. Consecutive transfers never share destination blocks. One warm-up round, then
``--rounds`` with transports in rotating order; prints the medians and nixl / zmq+curve.
``--checksum``: CRC-32 sent and required on every transport (off by default).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import multiprocessing
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any  # pipe messages and the figures are JSON

import torch

from pdserve.kvtransfer import make_receiver, make_sender
from pdserve.kvtransfer.base import KVPoll, KVReceiver, KVSender, TransferSpec
from pdserve.launch.keygen import keygen
from pdserve.protocol.control import KVRegions
from pdserve.protocol.messages import ProtocolError, decode, encode
from pdserve.protocol.transfer import KVPeer, KVPeers
from pdserve.runtime.security import SecureContext, Security

LAYERS = 8
BLOCK = (2, 16, 8, 64)  # a block of a layer, [2, block_size, num_kv_heads, head_dim]: 64 KiB
BLOCK_BYTES = LAYERS * 2 * 16 * 8 * 64 * 4  # one block across layers: 512 KiB
MIB = 1 << 20
SIZES_MIB = (1, 16, 256)
SRC_BLOCKS = 256 * MIB // BLOCK_BYTES  # the largest transfer: 512 blocks
DST_BLOCKS = 2 * SRC_BLOCKS
TRANSPORTS = ("zmq", "zmq+curve", "nixl")
TIMEOUT_S = 60.0  # a transfer's deadline, and the longest wait for the other process
Msg = tuple[dict[str, Any], list[bytes]]  # a pipe message: JSON fields, protocol frames
Rates = dict[str, dict[int, list[float]]]  # transport -> transfer size in MiB -> MB/s a round


def put(conn: Connection, msg: dict[str, Any], frames: Sequence[bytes] = ()) -> None:
    """One message over the pipe: JSON, then its protocol frames (regions) if any."""
    conn.send_bytes(json.dumps({**msg, "frames": len(frames)}).encode())
    for frame in frames:
        conn.send_bytes(frame)


def get(conn: Connection, timeout_s: float | None = TIMEOUT_S) -> Msg:
    """The next message (``None``: wait for ever); an error the receiver sent raises here."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer over the pipe in {timeout_s:.0f} s")
    msg = json.loads(conn.recv_bytes())
    frames = [conn.recv_bytes() for _ in range(msg.pop("frames"))]
    if "error" in msg:
        raise RuntimeError(f"the receiver process failed:\n{msg['error']}")
    return msg, frames


def regions_frames(worker_id: str, endpoint: KVSender | KVReceiver) -> list[bytes]:
    """The endpoint's regions as the coordinator would announce them; none for zmq."""
    if endpoint.regions is None:
        return []
    peers = KVPeers(added=[KVPeer(worker_id=worker_id, regions=endpoint.regions)])
    frames: list[bytes] = encode(peers)
    return frames


def peers_of(frames: list[bytes]) -> list[tuple[str, KVRegions]]:
    msg = decode(frames)
    if not isinstance(msg, KVPeers):
        raise ProtocolError(f"expected KVPeers, got {type(msg).__name__}")
    return [(peer.worker_id, peer.regions) for peer in msg.added]


def serve_receiver(conn: Connection, transport: str, keys: str, checksum: bool) -> None:
    """The receiver process: one receiver, answering the parent over ``conn`` until "stop"."""
    faulthandler.enable()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so ``finally`` closes the receiver
    torch.set_num_threads(1)
    ctx, receiver = None, None
    try:
        if transport == "zmq+curve":
            ctx = SecureContext(Security.load(keys, "d"))
        dst = [torch.ones((DST_BLOCKS, *BLOCK)) for _ in range(LAYERS)]  # every page written
        if transport == "nixl":
            receiver = make_receiver("nixl", dst, require_checksum=checksum)
        else:
            receiver = make_receiver("zmq", dst, require_checksum=checksum, ctx=ctx)
        put(conn, {"address": receiver.address}, regions_frames("recv", receiver))
        serve(conn, receiver)
    except Exception:
        with contextlib.suppress(OSError, ValueError):
            put(conn, {"error": traceback.format_exc()})
    finally:
        if receiver is not None:
            receiver.close()
        if ctx is not None:
            ctx.term()
        conn.close()


def serve(conn: Connection, receiver: KVReceiver) -> None:
    """Answer the parent: load peers; expect a round's transfers, report when they are over."""
    cursor = 0  # the next destination block
    while True:
        msg, frames = get(conn, None)
        if msg["op"] == "stop":
            return
        if msg["op"] == "peers":
            receiver.update_peers(peers_of(frames), [])
            put(conn, {"loaded": True})
            continue
        blocks, transfers = msg["blocks"], []
        for i in range(msg["n"]):
            rid, dst = f"{msg['tag']}-{i}", [(cursor + b) % DST_BLOCKS for b in range(blocks)]
            cursor = (cursor + blocks) % DST_BLOCKS
            transfers.append((rid, receiver.expect(rid, dst, TIMEOUT_S).hex(), dst))
        put(conn, {"transfers": transfers})
        states = final_states(conn, receiver, [rid for rid, _, _ in transfers])
        failed = [f"{r}: {receiver.failure_reason(r)}" for r, st in states if st is not KVPoll.DONE]
        put(conn, {"failed": failed})
        for rid, _, _ in transfers:
            receiver.release(rid)


def final_states(
    conn: Connection, receiver: KVReceiver, request_ids: list[str]
) -> list[tuple[str, KVPoll]]:
    """Each transfer's final state, polled in the order they were sent (a receiver has no
    callback: ``notify`` is a sender's); the parent says nothing mid-round: a readable pipe
    means it went away (so a receiver never outlives it by a transfer's timeout)."""
    states = []
    for rid in request_ids:
        deadline = time.monotonic() + TIMEOUT_S
        while not (state := receiver.poll(rid)).finished:
            if conn.poll(0):
                raise EOFError("the parent went away mid-round")
            if time.monotonic() > deadline:
                raise TimeoutError(f"transfer {rid} did not finish in {TIMEOUT_S:.0f} s")
            time.sleep(0.001)
        states.append((rid, state))
    return states


@dataclass
class Link:
    """One transport: its receiver process, the pipe to it, and the sender that reaches it."""

    transport: str
    proc: BaseProcess
    conn: Connection
    address: str = ""
    sender: KVSender | None = None
    ctx: SecureContext | None = None


def start(transport: str, keys: str, checksum: bool) -> Link:
    mp = multiprocessing.get_context("spawn")
    conn, child = mp.Pipe()
    args = (child, transport, keys, checksum)
    proc = mp.Process(target=serve_receiver, args=args, name=f"kv-{transport}", daemon=True)
    proc.start()
    child.close()  # ours closed, so a receiver that dies reads as EOF here
    return Link(transport, proc, conn)


def connect(link: Link, keys: str, checksum: bool, src: list[torch.Tensor]) -> None:
    """Make the link's sender; NIXL's sides learn each other's regions first."""
    hello, frames = get(link.conn)
    link.address = hello["address"]
    if link.transport == "nixl":
        link.sender = make_sender("nixl", kv_layers=src, checksum=checksum)
        link.sender.update_peers(peers_of(frames), [])
        put(link.conn, {"op": "peers"}, regions_frames("send", link.sender))
        get(link.conn)  # loaded: our first offer finds us known
    else:
        link.ctx = SecureContext(Security.load(keys, "p")) if link.transport != "zmq" else None
        link.sender = make_sender("zmq", checksum=checksum, ctx=link.ctx)


def stop(link: Link) -> None:
    """Close the sender; end the receiver process: asked, else terminated, else killed."""
    try:
        if link.sender is not None:
            link.sender.close()
        if link.ctx is not None:
            link.ctx.term()
    finally:
        with contextlib.suppress(OSError, ValueError):
            put(link.conn, {"op": "stop"})
        for end in (None, link.proc.terminate, link.proc.kill):
            if end is not None and link.proc.is_alive():
                end()
            link.proc.join(10)
        link.conn.close()


def one_round(link: Link, src: list[torch.Tensor], blocks: int, n: int, tag: str) -> float:
    """MB/s of ``n`` transfers of ``blocks`` blocks each, sent back to back."""
    sender = link.sender
    if sender is None:
        raise RuntimeError(f"{link.transport}: not connected")
    put(link.conn, {"op": "expect", "blocks": blocks, "n": n, "tag": tag})
    specs = []
    for i, (rid, secret, dst) in enumerate(get(link.conn)[0]["transfers"]):
        first = i * blocks % SRC_BLOCKS
        ids = list(range(first, first + blocks))
        specs.append(TransferSpec(rid, ids, dst, link.address, TIMEOUT_S, bytes.fromhex(secret)))
    start_s = time.perf_counter()
    for spec in specs:
        sender.send(spec, src)
    failed = get(link.conn)[0]["failed"]
    seconds = time.perf_counter() - start_s
    if failed:
        raise RuntimeError(f"{link.transport}: {len(failed)} transfers failed: {failed[:3]}")
    deadline = time.monotonic() + TIMEOUT_S
    for spec in specs:  # nixl: the reader's acknowledgement ends the sender's lease
        while not (state := sender.poll(spec.request_id)).finished:
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
        sender.release(spec.request_id)
        if state is not KVPoll.DONE:
            raise RuntimeError(f"{link.transport}: {spec.request_id} is {state.value} here")
    return n * blocks * BLOCK_BYTES / seconds / 1e6


def transfers_per_round(size_mib: int, round_mib: int) -> int:
    return max(2, round_mib // size_mib)


def measure(links: list[Link], src: list[torch.Tensor], rounds: int, round_mib: int) -> Rates:
    """MB/s of every counted round."""
    rates: Rates = {k.transport: {} for k in links}
    for r in range(rounds + 1):  # round 0 warms up
        for size in SIZES_MIB:
            order = links[r % len(links) :] + links[: r % len(links)]
            for link in order:
                n = transfers_per_round(size, round_mib)
                rate = one_round(link, src, size * MIB // BLOCK_BYTES, n, f"{r}-{size}")
                if r:
                    rates[link.transport].setdefault(size, []).append(rate)
        print(f"round {r}/{rounds}{' (warm-up)' if r == 0 else ''} done", file=sys.stderr)
    return rates


def report(rates: Rates, args: argparse.Namespace) -> dict[str, Any]:
    """Print the table of medians; the figures for ``--out``."""
    names = list(rates)
    med = {t: {s: statistics.median(v) for s, v in by.items()} for t, by in rates.items()}
    ratio = {}
    if "nixl" in med and "zmq+curve" in med:
        ratio = {s: med["nixl"][s] / med["zmq+curve"][s] for s in SIZES_MIB}
    checks = "on" if args.checksum else "off"
    print(f"\nKV transfer between two processes, host memory, {LAYERS} layers x 64 KiB blocks;")
    print(f"median MB/s of {args.rounds} rounds (N transfers back to back); checksums {checks}")
    head = f"{'size':>8} {'N':>5} " + "".join(f"{t:>11}" for t in names)
    print(head + ("   nixl/curve" if ratio else ""))
    for s in SIZES_MIB:
        row = f"{s:>4} MiB {transfers_per_round(s, args.round_mib):>5} "
        row += "".join(f"{med[t][s]:>11.0f}" for t in names)
        print(row + (f"{ratio[s]:>12.2f}x" if ratio else ""))
    return {
        "config": {"rounds": args.rounds, "round_mib": args.round_mib, "checksum": args.checksum},
        "mbps": {
            t: {str(s): {"median": med[t][s], "rounds": rates[t][s]} for s in SIZES_MIB}
            for t in names
        },
        "nixl_over_curve": {str(s): r for s, r in ratio.items()},
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="counted rounds (after one warm-up)")
    p.add_argument("--round-mib", type=int, default=512, help="MiB a round moves, per size")
    p.add_argument("--checksum", action="store_true", help="CRC-32 on every transfer")
    p.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    p.add_argument("--out", help="write the figures here as JSON")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    faulthandler.enable()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the receivers are stopped
    torch.set_num_threads(1)
    src = [torch.randn((SRC_BLOCKS, *BLOCK)) for _ in range(LAYERS)]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        keys = str(keygen(f"{tmp}/keys", {"p": frozenset({"prefill"}), "d": frozenset({"decode"})}))
        links = []
        for transport in args.transports:  # every receiver starts before the first waits
            links.append(start(transport, keys, args.checksum))
            stack.callback(stop, links[-1])
        for link in links:
            connect(link, keys, args.checksum, src)
        rates = measure(links, src, args.rounds, args.round_mib)
    figures = report(rates, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
