"""The cost of CURVE on the zmq KV transfer path: one sender, one receiver, host memory.

    .venv/bin/python bench/micro/kv_curve.py [--blocks 64] [--rounds 5] [--transfers 20]

Prints MB/s (median of ``--rounds``, each ``--transfers`` transfers back to back) with plain
sockets and with CURVE (the cluster default), on this machine's loopback.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from pdserve.kvtransfer import make_receiver, make_sender
from pdserve.kvtransfer.base import KVPoll, TransferSpec
from pdserve.launch.keygen import keygen
from pdserve.runtime.security import SecureContext, Security

SHAPE = (256, 2, 16, 8, 64)  # [num_blocks, 2, block_size, num_kv_heads, head_dim]: 256 KiB a block
LAYERS = 8


def one_round(ctx_send, ctx_recv, blocks: int, transfers: int) -> float:
    src = [torch.randn(SHAPE) for _ in range(LAYERS)]
    dst = [torch.zeros(SHAPE) for _ in range(LAYERS)]
    receiver = make_receiver("zmq", dst, ctx=ctx_recv)
    sender = make_sender("zmq", ctx=ctx_send)
    try:
        ids = list(range(blocks))
        start = time.perf_counter()
        for i in range(transfers):
            rid = f"r{i}"
            secret = receiver.expect(rid, ids, 60.0)
            sender.send(TransferSpec(rid, ids, ids, receiver.address, 60.0, secret), src)
            while not receiver.poll(rid).finished:
                time.sleep(0.0002)
            if receiver.poll(rid) is not KVPoll.DONE:
                raise RuntimeError(receiver.failure_reason(rid))
            receiver.release(rid)
            sender.release(rid)
        seconds = time.perf_counter() - start
    finally:
        sender.close()
        receiver.close()
    nbytes = transfers * LAYERS * blocks * src[0][0].numel() * src[0].element_size()
    return nbytes / seconds / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--transfers", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        keys = keygen(f"{tmp}/keys", ["p", "d"])
        curve = (SecureContext(Security.load(keys, "p")), SecureContext(Security.load(keys, "d")))
        plain = (None, None)
        mb = SHAPE[1] * SHAPE[2] * SHAPE[3] * SHAPE[4] * 4 * LAYERS * args.blocks / 1e6
        print(f"zmq KV transfer, {args.blocks} blocks x {LAYERS} layers = {mb:.1f} MB each")
        results = {}
        for name, (cs, cr) in (("plain", plain), ("curve", curve)):
            rates = [one_round(cs, cr, args.blocks, args.transfers) for _ in range(args.rounds)]
            results[name] = statistics.median(rates)
            print(f"{name:6s} median {results[name]:8.0f} MB/s  rounds {[round(r) for r in rates]}")
        for ctx in curve:
            ctx.term()
        print(f"curve / plain: {results['curve'] / results['plain']:.2f}")


if __name__ == "__main__":
    main()
