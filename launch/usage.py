"""``pdserve usage``: each tenant's totals from a usage record (``gateway/tenancy/usage.py``).

    pdserve usage --usage-db usage.db --tenants tenants.toml --since 2026-11-01 [--json]

A tenant's row adds up its models' rows, which follow it. ``--since`` and ``--until`` are a
date (midnight UTC) or an ISO time (UTC when it names no zone); the range is
``since <= finished_at < until``. ``--tenants`` adds each tenant the file names with no usage,
as zeros; a tenant with usage that the file no longer names is still shown.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from pdserve.gateway.metrics import Outcome
from pdserve.gateway.tenancy.tenants import TenantsError, load_tenants
from pdserve.gateway.tenancy.usage import EPOCH, UsageDbError, UsageStore, UsageTotals

ALL_MODELS = "*"
TOKENS = ("prompt_tokens", "completion_tokens", "cached_tokens")


def add_usage_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--usage-db", required=True, metavar="FILE", help="the usage record")
    parser.add_argument("--tenants", metavar="FILE", help="list this file's tenants, zeros too")
    parser.add_argument("--since", type=parse_time, metavar="YYYY-MM-DD", help="from (UTC)")
    parser.add_argument("--until", type=parse_time, metavar="YYYY-MM-DD", help="before (UTC)")
    parser.add_argument("--json", action="store_true", help="JSON instead of a table")


def parse_time(text: str) -> datetime:
    """A date (its midnight) or an ISO time; UTC unless it names its zone."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a date or ISO time: {text!r}") from e
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def run_usage(args: argparse.Namespace) -> int:
    since = args.since or EPOCH
    try:
        rows = UsageStore(args.usage_db, create=False).totals(since, args.until)
        names = [t.name for t in load_tenants(args.tenants)] if args.tenants else []
    except (UsageDbError, TenantsError, OSError) as e:
        print(f"pdserve usage: {e}", file=sys.stderr)
        return 1
    tenants = by_tenant(rows, names)
    if args.json:
        until = args.until.isoformat() if args.until else None
        doc = {"since": since.isoformat(), "until": until, "tenants": to_json(tenants)}
        print(json.dumps(doc, indent=2))
    else:
        print(table(tenants))
    return 0


def by_tenant(
    rows: Iterable[UsageTotals], names: Iterable[str] = ()
) -> list[tuple[UsageTotals, list[UsageTotals]]]:
    """(the tenant's sum, its per-model rows), by tenant name; ``names`` with no rows: zeros."""
    models: dict[str, list[UsageTotals]] = {name: [] for name in names}
    for row in rows:
        models.setdefault(row.tenant, []).append(row)
    return [(sum_totals(name, models[name]), models[name]) for name in sorted(models)]


def sum_totals(tenant: str, parts: Iterable[UsageTotals]) -> UsageTotals:
    """One row adding up ``parts``, its model ``*``."""
    out = UsageTotals(tenant=tenant, model=ALL_MODELS)
    for part in parts:
        for outcome, count in part.requests.items():
            out.requests[outcome] += count
        out.prompt_tokens += part.prompt_tokens
        out.completion_tokens += part.completion_tokens
        out.cached_tokens += part.cached_tokens
    return out


def _as_dict(t: UsageTotals) -> dict[str, Any]:
    requests = {"total": t.request_count} | {o.value: t.requests[o] for o in Outcome}
    return {"requests": requests} | {name: getattr(t, name) for name in TOKENS}


def to_json(tenants: list[tuple[UsageTotals, list[UsageTotals]]]) -> list[dict[str, Any]]:
    return [
        {"tenant": total.tenant}
        | _as_dict(total)
        | {"models": [{"model": m.model} | _as_dict(m) for m in models]}
        for total, models in tenants
    ]


def table(tenants: list[tuple[UsageTotals, list[UsageTotals]]]) -> str:
    """A text table: a tenant's row (model ``*``), then one row per model."""
    head = ["tenant", "model", "requests", *(o.value for o in Outcome), *TOKENS]
    lines = [head]
    for total, models in tenants:
        for t in (total, *models):
            counts = [t.request_count, *(t.requests[o] for o in Outcome)]
            tokens = [getattr(t, name) for name in TOKENS]
            lines.append([t.tenant, t.model, *(str(n) for n in (*counts, *tokens))])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i < 2 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in lines
    )
