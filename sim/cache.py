"""A worker's prefix cache as the simulator sees it: which prefixes (``SimRequest.prefixes``
keys) it holds and how many of their tokens, least recently used first out.

The real cache holds chained block hashes, so a conversation's turns share their blocks; here
each key counts its own tokens, so a chain of turns counts its history more than once and is
evicted a little early (the capacity is what the worker's free KV holds)."""

from __future__ import annotations

from collections import OrderedDict

from pdserve.sim.seq import PromptJob


class PrefixCache:
    """``enabled`` False (``--no-enable-prefix-caching``): it holds nothing, so finds nothing."""

    def __init__(self, block_size: int, enabled: bool = True) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self._held: OrderedDict[str, int] = OrderedDict()
        self.tokens = 0  # summed over keys

    def peek(self, prefixes: tuple[tuple[str, int], ...], refresh: bool = False) -> int:
        """Tokens of the longest of ``prefixes`` held here, in whole blocks (what the
        coordinator's index knows); ``refresh``: a lookup, which refreshes what it finds."""
        best = 0
        for key, tokens in prefixes:
            held = self._held.get(key)
            if held is not None:
                if refresh:
                    self._held.move_to_end(key)
                best = max(best, min(held, tokens))
        return best // self.block_size * self.block_size

    def hit(self, prefixes: tuple[tuple[str, int], ...]) -> int:
        """``peek`` as a worker's lookup does it, refreshing what it finds."""
        return self.peek(prefixes, refresh=True)

    def insert(self, key: str, tokens: int, capacity: int) -> None:
        """Hold ``tokens`` of ``key`` (the most held so far), then evict down to
        ``capacity`` tokens."""
        if not self.enabled:
            return
        held = self._held.pop(key, 0)
        self.tokens -= held
        tokens = max(held, tokens) // self.block_size * self.block_size
        if tokens:
            self._held[key] = tokens
            self.tokens += tokens
        self.trim(capacity)

    def trim(self, capacity: int) -> None:
        while self.tokens > max(0, capacity) and self._held:
            _, tokens = self._held.popitem(last=False)
            self.tokens -= tokens


def look_up(cache: PrefixCache, job: PromptJob) -> int:
    """A prompt admitted by a worker's scheduler: what its cache holds of it now (the real
    engine looks the prefix up at admission, not when the coordinator placed it) sets the
    tokens it computes; the change in them. A recompute computes everything."""
    if job.recompute or job.done:
        return 0
    req = job.seq.out.req
    tokens = max(1, req.prompt_tokens - cache.hit(req.prefixes))
    change = tokens - job.tokens
    job.tokens = tokens
    job.seq.out.computed = tokens
    return change


def offer(cache: PrefixCache, job: PromptJob, capacity: int) -> None:
    """After a chunk: the prefixes the prompt's computed positions now cover enter the cache
    (the real one caches each full block as it is computed)."""
    if job.recompute:
        return
    req = job.seq.out.req
    covered = req.prompt_tokens - job.tokens + job.done
    for key, tokens in req.prefixes:
        if tokens <= covered:
            cache.insert(key, tokens, capacity)
