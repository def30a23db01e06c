"""The UCX receiver: probes headers and layer messages, stages, checks, scatters.

Per transfer (see ``ucx_backend`` for the tags)::

    header probed ─▶ expected & layout fits? ─yes─▶ TRANSFERRING: each layer message probed,
                          │                          right length → staging, else → sink
                          no ─▶ FAILED (or dropped when not expected); every layer → sink
    all layers in ─▶ checksum ─▶ scatter into kv_layers[l][dst_ids] ─▶ DONE
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kvtransfer import common, table
from pdserve.kvtransfer.base import DEFAULT_TIMEOUT_S, KVPoll, KVReceiver
from pdserve.kvtransfer.ucx_backend import (
    BUSY_SLEEP_S,
    DEFAULT_BIND,
    HEADER_TAG,
    HELLO,
    IDLE_SLEEP_S,
    UcxWorker,
    layer_tag,
    parse_address,
    request_error,
)
from pdserve.protocol.messages import KVHeader, ProtocolError, decode

log = logging.getLogger("pdserve.kvtransfer.ucx")

_MAX_HEADER_BYTES = 1 << 20
_MAX_LAYERS = 1 << 16


@dataclass
class _Incoming:
    header: KVHeader
    entry: table.Entry | None  # None: not expected, every layer goes to a sink
    staged: list[torch.Tensor] | None  # uint8 [layer nbytes] per layer; None if rejected at once
    deadline: float
    reqs: list[Any] = field(default_factory=list)  # per layer: None until its message is probed
    sinks: list[bytearray] = field(default_factory=list)
    problem: str | None = None  # once set, every later layer goes to a sink

    @property
    def draining(self) -> bool:
        return self.staged is None or self.problem is not None


class UcxKVReceiver(table.TableBackedReceiver, KVReceiver):
    def __init__(
        self,
        kv_layers: list[torch.Tensor],
        bind: str = DEFAULT_BIND,
        *,
        require_checksum: bool = False,
    ) -> None:
        self._layout = common.check_host_layers(kv_layers)
        self._init_receiver("ucx", kv_layers, require_checksum)
        host, port = parse_address(bind)
        self._ucx = UcxWorker()
        self._endpoints: list[tuple[Any, Any]] = []  # accepted (endpoint, HELLO send) pairs
        self._listener = self._ucx.lib.UCXListener.create(
            self._ucx.worker, port, self._on_connect, deliver_endpoint=True
        )
        # UCX listens on every interface; the address names the host senders should use
        self._start_thread("ucx", f"ucx://{host}:{self._listener.port}")

    def close(self) -> None:
        if not self._stop_thread():
            return
        self._listener = None
        for ep, _ in self._endpoints:
            ep.close_blocking(period=10**9, max_attempts=1)
        self._endpoints.clear()
        self._ucx.close()

    def _on_connect(self, ep: Any) -> None:
        """On UCX's progress thread: greet the sender, which waits for this before sending."""
        self._endpoints.append((ep, ep.stream_send(self._ucx.Array(HELLO))))

    # ---- receiver thread ---------------------------------------------------------------------

    def _run(self) -> None:
        incoming: list[_Incoming] = []
        while not self._stop.is_set():
            busy = False
            try:
                header_in = self._take_header()
                if header_in is not None:
                    incoming.append(header_in)
                    busy = True
                for inc in incoming:
                    busy |= self._probe_layers(inc)
                done = [inc for inc in incoming if self._settled(inc)]
                for inc in done:
                    incoming.remove(inc)
                    self._finish(inc)
            except Exception:  # a bad transfer must never kill the receiver
                log.exception("ucx receiver: unexpected error")
            self._table.expire()
            time.sleep(BUSY_SLEEP_S if busy or incoming else IDLE_SLEEP_S)

    def _take_header(self) -> _Incoming | None:
        probe = self._ucx.probe(HEADER_TAG)
        if not probe.matched:
            return None
        buf = bytearray(min(probe.length, _MAX_HEADER_BYTES) or 1)
        req = self._ucx.recv(buf, probe)
        deadline = time.monotonic() + 5.0
        while not req.completed and time.monotonic() < deadline:
            time.sleep(BUSY_SLEEP_S)
        if not req.completed or request_error(req) is not None:
            log.warning("ucx receiver: dropped a header of %d bytes", probe.length)
            return None
        try:
            header = decode([bytes(buf)])
        except ProtocolError as exc:
            log.warning("ucx receiver: dropped a bad header: %s", exc)
            return None
        if not isinstance(header, KVHeader) or not 0 < header.tag < 1 << 47:
            log.warning("ucx receiver: dropped a header without a valid transfer tag")
            return None
        if not 0 < header.num_layers <= _MAX_LAYERS:
            log.warning("ucx receiver: dropped a header with %d layers", header.num_layers)
            return None
        return self._accept(header)

    def _accept(self, header: KVHeader) -> _Incoming:
        rid = header.request_id
        with self._table.lock:
            entry = self._table.get(rid)
            if entry is not None and not table.secret_matches(entry, header.secret):
                # not the sender the reservation was made for: its layers go to the sink and
                # the reservation stays PENDING for the real one
                log.warning("ucx receiver: draining a transfer for %r without its secret", rid)
                entry = None
            if entry is None or entry.state is not KVPoll.PENDING:
                state = "unknown" if entry is None else entry.state.value
                log.warning("ucx receiver: draining a transfer for %s request %r", state, rid)
                deadline = time.monotonic() + DEFAULT_TIMEOUT_S
                reqs = [None] * header.num_layers
                return _Incoming(header, None, None, deadline, reqs, problem="not expected")
            self._table.advance(rid, KVPoll.TRANSFERRING)
        problem = common.header_problem(
            header, self._layout, entry.block_ids, self.require_checksum
        )
        staged = None
        if problem is None:
            nbytes = common.layer_nbytes(self._layout, len(entry.block_ids))
            staged = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(header.num_layers)]
        else:
            self._table.advance(rid, KVPoll.FAILED, problem)
        reqs = [None] * header.num_layers
        return _Incoming(header, entry, staged, entry.deadline, reqs, problem=problem)

    def _probe_layers(self, inc: _Incoming) -> bool:
        """Post a receive for every layer message that has arrived; True if any did."""
        if time.monotonic() > inc.deadline:
            return False  # stop waiting for layers that never came
        got = False
        for layer, req in enumerate(inc.reqs):
            if req is not None:
                continue
            probe = self._ucx.probe(layer_tag(inc.header.tag, layer))
            if not probe.matched:
                continue
            got = True
            if not inc.draining and probe.length != inc.staged[layer].numel():
                want = inc.staged[layer].numel()
                inc.problem = f"layer {layer} is {probe.length} bytes, expected {want}"
            if inc.draining:
                inc.sinks.append(bytearray(1))
                inc.reqs[layer] = self._ucx.recv(inc.sinks[-1], probe)
            else:
                inc.reqs[layer] = self._ucx.recv(common.as_bytes(inc.staged[layer]), probe)
        return got

    def _settled(self, inc: _Incoming) -> bool:
        posted = [r for r in inc.reqs if r is not None]
        if len(posted) < len(inc.reqs) and time.monotonic() <= inc.deadline:
            return False
        return all(r.completed for r in posted)

    def _finish(self, inc: _Incoming) -> None:
        if inc.entry is None:
            return
        rid, problem = inc.header.request_id, inc.problem
        if problem is None and None in inc.reqs:
            problem = "not every layer arrived"
        if problem is None:
            problem = next((e for e in map(request_error, inc.reqs) if e), None)
        if problem is None:
            buffers = [common.as_bytes(t) for t in inc.staged]
            problem = common.payload_problem(inc.header, self._layout, buffers)
        with self._table.lock:
            if self._table.get(rid) is not inc.entry or inc.entry.state.finished:
                return  # released, timed out or failed meanwhile
            if problem is None:
                common.scatter(self._layers, inc.entry.block_ids, buffers)
            self._table.advance(rid, KVPoll.FAILED if problem else KVPoll.DONE, problem)
