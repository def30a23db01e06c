"""coordinator.routes: the route table's request index stays in step with its routes."""

from __future__ import annotations

import pytest

from pdserve.coordinator.routes import Route, RouteState, RouteStateError, RouteTable
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


def test_transitions_check_the_state_they_leave() -> None:
    req = _route("a", 0).request
    route = Route.queued(req, 0, choices=2, need=3, now=1.0, arrived=1.0)
    with pytest.raises(RouteStateError, match="prefilling from queued, not reserving"):
        route.prefill_on("p0", None, 2.0)  # type: ignore[arg-type]
    route.reserve_on("d0", 2.0)
    assert (route.state, route.decode, route.since) == (RouteState.RESERVING, "d0", 2.0)
    with pytest.raises(RouteStateError):
        route.reserve_on("d1", 3.0)
    job = m.PrefillJob(
        request_id="a",
        prompt_token_ids=[1, 2],
        sampling=SPEC,
        n=3,
        dst_block_ids=[0],
        transfer_address="t",
        stream_address="gw",
    )
    route.prefill_on("p0", job, 3.0)
    assert (route.state, route.prefill, route.job) == (RouteState.PREFILLING, "p0", job)
    route.prefill_moves_to("p1", 4.0)
    assert (route.prefill, route.tried, route.since) == ("p1", {"p0"}, 4.0)
    [second] = route.decoding({0}, 5.0)  # token 0 ended choice 0
    assert (second.choice, second.state, second.decode, second.since) == (
        1,
        RouteState.DECODING,
        "d0",
        5.0,
    )
    with pytest.raises(RouteStateError):
        second.decoding(set(), 6.0)


def test_no_route_state_is_assigned_outside_the_routes_module() -> None:
    """A route's state changes only through its transitions (coordinator/routes.py)."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "coordinator"
    found = []
    for path in sorted(folder.glob("*.py")):
        if path.name == "routes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(el, ast.Attribute) and el.attr == "state":
                        found.append(f"{path.name}:{node.lineno}")
            if (  # Route(..., RouteState.X, ...) made elsewhere sets a state too
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "Route"
            ):
                found.append(f"{path.name}:{node.lineno}")
    assert found == []
