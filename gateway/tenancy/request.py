"""Tenancy on the HTTP path: a request's tenant applied to its job (its ``max_tokens`` cap and
its share of the cluster), the run's hold on its tenant's limits (``HoldListener``), and the
``x-ratelimit-*`` headers on every answer (``RateLimitHeaders``)."""

from __future__ import annotations

import dataclasses
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.gateway.errors import OpenAIError
from pdserve.gateway.jobs import Job
from pdserve.gateway.metrics import Outcome
from pdserve.gateway.openai_models import AnyRequest, ChatCompletionRequest
from pdserve.gateway.run import Usage
from pdserve.gateway.tenancy.core import RATELIMIT_HEADERS, TENANT, Hold, Tenancy
from pdserve.gateway.tenancy.tenants import Tenant
from pdserve.protocol.tenancy import Share

log = logging.getLogger(__name__)


def check_max_tokens(req: AnyRequest, tenant: Tenant) -> None:
    """A request asking for more than its tenant's ``max_tokens`` is a 400 naming the field."""
    cap, requested = tenant.max_tokens, req.requested_max_tokens()
    if cap is not None and requested is not None and requested > cap:
        chat = isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None
        param = "max_completion_tokens" if chat else "max_tokens"
        message = f"{param} is {requested}, more than this key's limit of {cap} per request"
        raise OpenAIError(400, message, param=param, code="max_tokens_exceeded")


def for_tenant(job: Job, tenant: Tenant, priority: int) -> Job:
    """``job`` with each request's share of the cluster (its tenant's tier and weight, its own
    ``priority``), and its ``max_tokens`` capped at the tenant's (where the request left it to
    the default)."""
    share = Share(tenant=tenant.name, tier=tenant.tier, weight=tenant.weight, priority=priority)
    cap = tenant.max_tokens
    requests = []
    for r in job.requests:
        r = dataclasses.replace(r, share=share)
        if cap is not None and r.sampling.max_tokens > cap:
            try:
                r = dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_tokens=cap))
            except ValueError as e:  # min_tokens above the cap
                message = f"{e} (the limit of this key)"
                raise OpenAIError(400, message, param="min_tokens") from None
        requests.append(r)
    return dataclasses.replace(job, requests=requests)


def reserved_tokens(job: Job) -> tuple[int, int]:
    """What admission takes for ``job``: its prompt tokens, and every choice's ``max_tokens``."""
    prompt = sum(len(r.prompt_token_ids) for r in job.requests)
    completion = sum(r.sampling.max_tokens * r.n for r in job.requests)
    return prompt, completion


@dataclasses.dataclass
class HoldListener:
    """A ``JobRun``'s listener: charges its tenant as it streams, gives back and meters at its
    end."""

    tenancy: Tenancy
    hold: Hold

    def tokens(self, completion_tokens: int) -> None:
        self.tenancy.tokens(self.hold, completion_tokens)

    async def ended(self, outcome: Outcome, usage: Usage) -> None:
        await self.tenancy.finish(
            self.hold,
            outcome,
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_tokens,
        )


class RateLimitHeaders:
    """Adds ``request.state``'s ``x-ratelimit-*`` headers to the answer of a limited tenant's
    generation request; where admission never ran (a 400 before it), the standing now."""

    def __init__(self, app: ASGIApp, tenancy: Tenancy, paths: tuple[str, ...]) -> None:
        self.app, self.tenancy, self.paths = app, tenancy, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                found = state.get(RATELIMIT_HEADERS)
                tenant = state.get(TENANT)
                if found is None and isinstance(tenant, Tenant):
                    try:
                        found = await self.tenancy.standing(tenant)
                    except Exception:  # an answer is never lost for want of its headers
                        log.exception("rate limit headers for tenant %s", tenant.name)
                if found:
                    have = {k.lower() for k, _ in message.get("headers", [])}
                    extra = [
                        (k.encode("latin-1"), v.encode("latin-1"))
                        for k, v in found.items()
                        if k.encode("latin-1") not in have
                    ]
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_limits)
