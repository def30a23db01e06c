"""coordinator.peers: workers learn each other's KV regions at registration (a prefill worker
its readers, a decode worker its senders), replace them when one restarts, forget the dead."""

from __future__ import annotations

from pdserve.coordinator.coordinator import Coordinator
from pdserve.protocol import messages as m
from pdserve.protocol.control import Heartbeat, KVLayout, KVRegions, Register, WorkerLoad
from pdserve.protocol.transfer import KVPeer, KVPeers

LAYOUT = KVLayout(block_size=4, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8)


class Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[str, m.Message]] = []

    def to_worker(self, worker_id: str, address: str, msg: m.Message) -> None:
        assert address == f"tcp://{worker_id}:1"
        self.sent.append((worker_id, m.decode(m.encode(msg))))  # as it crosses the wire

    def to_gateway(self, address: str, msg: m.Message) -> None:
        pass

    def forget_worker(self, worker_id: str) -> None:
        pass

    def peers(self) -> list[tuple[str, KVPeers]]:
        out = [(w, msg) for w, msg in self.sent if isinstance(msg, KVPeers)]
        self.sent.clear()
        return out


def regions(agent: str) -> KVRegions:
    return KVRegions(
        agent=agent,
        metadata=agent.encode() * 40,
        mem="DRAM",
        device_id=0,
        layer_addrs=[1 << 40, (1 << 40) + 4096],
        block_bytes=512,
        num_blocks=8,
        layout=LAYOUT,
    )


def register(wid: str, role: str, agent: str | None, model: str = "tiny") -> Register:
    return Register(
        role=role,
        worker_id=wid,
        model=model,
        control_address=f"tcp://{wid}:1",
        transfer_address=f"nixl://{agent}" if role != "prefill" and agent else "",
        transfer_backend="nixl" if agent else "zmq",
        layout=LAYOUT,
        num_blocks=8,
        kv_regions=regions(agent) if agent else None,
    )


def peer(wid: str, agent: str) -> KVPeer:
    return KVPeer(worker_id=wid, regions=regions(agent))


def test_each_side_learns_the_other_at_registration() -> None:
    out = Outbox()
    c = Coordinator(out)
    c.handle(register("p0", "prefill", "ap0"), 0.0)
    assert out.peers() == []  # nobody to read from it yet
    c.handle(register("d0", "decode", "ad0"), 0.0)
    assert out.peers() == [
        ("p0", KVPeers(added=[peer("d0", "ad0")])),
        ("d0", KVPeers(added=[peer("p0", "ap0")])),
    ]
    c.handle(register("d1", "both", "ad1"), 0.0)  # a colocated worker reads too
    c.handle(register("p1", "prefill", "ap1"), 0.0)
    assert out.peers() == [
        ("p0", KVPeers(added=[peer("d1", "ad1")])),
        ("d1", KVPeers(added=[peer("p0", "ap0")])),
        ("d0", KVPeers(added=[peer("p1", "ap1")])),
        ("d1", KVPeers(added=[peer("p1", "ap1")])),
        ("p1", KVPeers(added=[peer("d0", "ad0"), peer("d1", "ad1")])),
    ]
    c.handle(register("d0", "decode", "ad0"), 1.0)  # the periodic re-send changes nothing
    assert out.peers() == []


def test_a_restart_replaces_and_a_death_forgets() -> None:
    out = Outbox()
    c = Coordinator(out, heartbeat_timeout_s=5.0)
    c.handle(register("p0", "prefill", "ap0"), 0.0)
    c.handle(register("d0", "decode", "ad0"), 0.0)
    out.peers()
    c.handle(register("d0", "decode", "ad0-new"), 1.0)  # the same id, a new process
    assert out.peers() == [
        ("p0", KVPeers(added=[peer("d0", "ad0-new")])),
        ("d0", KVPeers(added=[peer("p0", "ap0")])),
    ]
    c.handle(Heartbeat(worker_id="p0", load=WorkerLoad.idle(8)), 9.0)  # p0 lives on, d0 goes silent
    c.tick(9.0)
    assert "d0" not in c.registry.workers
    assert out.peers() == [("p0", KVPeers(gone=["d0"]))]


def test_workers_without_regions_or_of_another_model_are_not_introduced() -> None:
    out = Outbox()
    c = Coordinator(out)
    c.handle(register("p0", "prefill", "ap0", model="tiny"), 0.0)
    c.handle(register("d0", "decode", "ad0", model="other"), 0.0)
    c.handle(register("p1", "prefill", "ap1", model="tiny"), 0.0)  # prefill pairs with no prefill
    assert out.peers() == []
    c2 = Coordinator(out)
    c2.handle(register("p0", "prefill", None), 0.0)  # zmq: nothing to introduce
    c2.handle(register("d0", "decode", None), 0.0)
    assert out.peers() == []
