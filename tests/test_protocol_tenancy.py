"""protocol/tenancy.py on the wire: ``Share`` rides on ``Generate``, ``Reserve`` and
``PrefillJob`` and comes back typed (``Tier`` a ``Tier``, the weight a float); each of its
fields is checked on decode and a peer's bad value is the codec's ``ProtocolError`` naming it."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from pdserve.gateway.tenancy import tenants
from pdserve.protocol.messages import (
    Generate,
    PrefillJob,
    ProtocolError,
    Reserve,
    SamplingParams,
    Share,
    Tier,
    decode,
    encode,
)
from pdserve.protocol.tenancy import DEFAULT, share_of

SHARE = Share(tenant="acme.prod-1", tier=Tier.PREMIUM, weight=2.5, priority=-7)


def generate(share: Share | None = SHARE) -> Generate:
    return Generate(
        request_id="r1",
        model="tiny",
        prompt_token_ids=[1, 2],
        sampling=SamplingParams(),
        n=1,
        stream_address="ipc://gw",
        share=share,
    )


def test_the_share_round_trips_on_every_message_that_carries_it() -> None:
    reserve = Reserve(
        request_id="r1", prompt_token_ids=[1], sampling=SamplingParams(), n=1, stream_address="a"
    )
    job = PrefillJob(
        request_id="r1",
        prompt_token_ids=[1],
        sampling=SamplingParams(),
        n=1,
        dst_block_ids=[],
        transfer_address="",
        stream_address="a",
    )
    for msg in (generate(), reserve, job):
        with_share = dataclasses.replace(msg, share=SHARE)
        back = decode(encode(with_share))
        assert back == with_share and back.share == SHARE
        assert type(back.share.tier) is Tier and type(back.share.weight) is float
        assert decode(encode(msg)).share == msg.share  # None stays None
    whole = Share(tenant="t", tier=Tier.BATCH, weight=3)  # an int weight comes back a float
    assert decode(encode(generate(whole))).share.weight == 3.0


def test_its_wire_form_is_a_map_with_the_tier_by_value() -> None:
    (frame,) = encode(generate())
    assert msgpack.unpackb(frame)["share"] == {
        "tenant": "acme.prod-1",
        "tier": "premium",
        "weight": 2.5,
        "priority": -7,
    }
    (frame,) = encode(generate(None))
    assert msgpack.unpackb(frame)["share"] is None


def share_frames(**changes: object) -> list[bytes]:
    (frame,) = encode(generate())
    fields = msgpack.unpackb(frame)
    for name, value in changes.items():
        if value is ...:
            del fields["share"][name]
        else:
            fields["share"][name] = value
    return [msgpack.packb(fields, use_bin_type=True)]


NAME = "tenant must be 1 to 64 of A-Z a-z 0-9 _ . -"
WEIGHT = "weight must be a number from 0.001 to 1000"
PRIORITY = "priority must be an integer from -2147483648 to 2147483647"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tenant": ""}, f"Generate.share: {NAME}, got ''"),
        ({"tenant": "a b"}, f"Generate.share: {NAME}, got 'a b'"),
        ({"tenant": "x" * 65}, f"Generate.share: {NAME}, got '{'x' * 65}'"),
        ({"tenant": "é"}, f"Generate.share: {NAME}, got 'é'"),
        ({"tenant": 5}, "Generate.share.tenant: expected str, got int"),
        (
            {"tier": "gold"},
            "Generate.share.tier: expected one of ['batch', 'standard', 'premium'], got 'gold'",
        ),
        (
            {"tier": 2},
            "Generate.share.tier: expected one of ['batch', 'standard', 'premium'], got 2",
        ),
        ({"weight": 0}, f"Generate.share: {WEIGHT}, got 0.0"),
        ({"weight": 0.0009}, f"Generate.share: {WEIGHT}, got 0.0009"),
        ({"weight": 1000.5}, f"Generate.share: {WEIGHT}, got 1000.5"),
        ({"weight": -1}, f"Generate.share: {WEIGHT}, got -1.0"),
        ({"weight": float("nan")}, f"Generate.share: {WEIGHT}, got nan"),
        ({"weight": float("inf")}, f"Generate.share: {WEIGHT}, got inf"),
        ({"weight": "1"}, "Generate.share.weight: expected float, got str"),
        ({"priority": 2**31}, f"Generate.share: {PRIORITY}, got 2147483648"),
        ({"priority": -(2**31) - 1}, f"Generate.share: {PRIORITY}, got -2147483649"),
        ({"priority": 1.0}, "Generate.share.priority: expected int, got float"),
        ({"priority": True}, "Generate.share.priority: expected int, got bool"),
        ({"priority": ...}, "Generate.share: missing field 'priority'"),
        ({"cost": 1}, "Generate.share: unexpected field 'cost'"),
    ],
)
def test_a_bad_share_is_refused_by_the_codec(changes: dict, message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(share_frames(**changes))
    assert str(info.value) == message


def test_the_bounds_are_inclusive_and_a_share_is_checked_when_made() -> None:
    edge = Share(tenant="x" * 64, tier=Tier.BATCH, weight=1e-3, priority=-(2**31))
    assert decode(encode(generate(edge))).share == edge
    top = Share(tenant="_.-", tier=Tier.STANDARD, weight=1e3, priority=2**31 - 1)
    assert decode(encode(generate(top))).share == top
    with pytest.raises(ValueError, match=r"^tier must be a Tier, got 'premium'$"):
        Share(tenant="t", tier="premium", weight=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^priority must be an integer"):
        Share(tenant="t", tier=Tier.BATCH, weight=1, priority=True)


def test_no_share_is_the_default_tenant_and_tier_is_one_type_everywhere() -> None:
    assert share_of(None) is DEFAULT and share_of(SHARE) is SHARE
    assert Share(tenant="default", tier=Tier.STANDARD, weight=1, priority=0) == DEFAULT
    assert DEFAULT.tenant == tenants.UNLIMITED  # the tenant of --api-key
    assert tenants.Tier is Tier  # the tenants file's tiers are the wire's
    assert Tier.PREMIUM > Tier.STANDARD > Tier.BATCH and max(Tier) is Tier.PREMIUM
