"""coordinator.routes: the route table's request index stays in step with its routes."""

from __future__ import annotations

import pytest

from pdserve.coordinator.routes import Route, RouteState, RouteTable
from pdserve.protocol import messages as m
from pdserve.protocol.keys import ChoiceKey

SPEC = m.SamplingParams(max_tokens=4)


def _route(request_id: str, choice: int, n: int = 3) -> Route:
    request = m.Generate(
        request_id=request_id,
        model="tiny",
        prompt_token_ids=[1, 2],
        sampling=SPEC,
        n=n,
        stream_address="gw",
    )
    return Route(request, choice, RouteState.RESERVING)


def test_keys_of_a_request_and_one_of_its_choices() -> None:
    table = RouteTable()
    for rid in ("a", "b"):
        for choice in (2, 0, 1):
            table.add(_route(rid, choice))
    assert table.keys_of("a") == [("a", 0), ("a", 1), ("a", 2)]
    assert table.keys_of("b", 1) == [("b", 1)]
    assert table.keys_of("b", 5) == [] and table.keys_of("zzz") == []
    assert len(table) == 6 and table[("a", 2)].choice == 2


def test_pop_keeps_the_index_in_step() -> None:
    table = RouteTable()
    table.add(_route("a", 0, n=2))
    table.add(_route("a", 1, n=2))
    assert table.pop(ChoiceKey("a", 0)).choice == 0
    assert table.keys_of("a") == [("a", 1)]
    table.pop(ChoiceKey("a", 1))
    assert table == {} and table.keys_of("a") == []
    with pytest.raises(KeyError):
        table.pop(ChoiceKey("a", 1))
