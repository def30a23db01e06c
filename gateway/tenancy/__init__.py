"""Tenancy: who a request is for, what its tenant's limits let in, and what it used.
Tenants (``tenants``: the tenants file, a key to its tenant; ``tenants_text``: where things are
written in it, the edits of ``pdserve keys``), rate limits (``ratelimit``: token buckets,
reservations, OpenAI's headers and 429; ``limiter_store``: the store contract, in memory;
``redis_store``: shared through Redis, with a local fallback), usage (``usage``: the SQLite
usage record; ``meter``: live totals, batches to it off the request path), and what ties them
to a request: ``core`` (``Tenancy``: a key's tenant, admission, give-back, metering, the
``pdserve_tenant_*`` metrics), ``request`` (the tenant's cap and share on a job, the
``x-ratelimit-*`` headers on every answer) and ``args`` (the flags)."""
