"""The token streams of one job's prompts, merged onto one queue in arrival order, and watched.

A pump task per stream puts each chunk on the queue tagged with its prompt, then ``END`` once
the stream is exhausted, or what it raised. The watches: nothing from any stream for ``idle_s``
calls ``on_idle`` (the stream-idle bound: no failure anywhere can leave a request silent
longer); more than ``max_backlog`` events waiting for a consumer that does not keep up stops
every pump and calls ``on_backlog`` (a slow reader).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from pdserve.protocol.messages import TokenChunk

END = None  # what a pump puts on the queue when its stream is exhausted
Item = tuple[int, TokenChunk | BaseException | None]  # (prompt, what its stream gave); -1: none


class PromptStreams:
    """Owns the queue, the pump tasks that fill it, and the idle and backlog watches."""

    def __init__(
        self,
        clock: Callable[[], float],
        idle_s: float | None,
        max_backlog: int | None,
        on_idle: Callable[[], None],
        on_backlog: Callable[[], None],
    ) -> None:
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self._clock = clock
        self._idle_s = idle_s
        self._max_backlog = max_backlog
        self._on_idle = on_idle
        self._on_backlog = on_backlog
        self._pumps: list[asyncio.Task[None]] = []
        self._last_event_at = 0.0  # set by start
        self._idle_timer: asyncio.TimerHandle | None = None

    def start(self, streams: list[AsyncIterator[TokenChunk]]) -> None:
        """Pump every stream (prompt ``i`` is ``streams[i]``) and start the idle watch."""
        self._pumps = [
            asyncio.create_task(_pump(i, stream, self.queue, self._pumped))
            for i, stream in enumerate(streams)
        ]
        self._last_event_at = self._clock()
        if self._idle_s is not None:
            self._idle_timer = asyncio.get_running_loop().call_later(self._idle_s, self._check_idle)

    def stop(self, prompt: int) -> None:
        self._pumps[prompt].cancel()

    def stop_all(self) -> None:
        for pump in self._pumps:
            pump.cancel()

    def stop_watching(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()

    def _pumped(self) -> bool:
        """A pump queued an event; False stops it (the consumer is too far behind)."""
        self._last_event_at = self._clock()
        if self._max_backlog is None or self.queue.qsize() <= self._max_backlog:
            return True
        self._on_backlog()
        self.stop_all()
        return False

    def _check_idle(self) -> None:
        idle_s = self._idle_s or 0.0
        quiet = self._clock() - self._last_event_at
        if quiet >= idle_s:
            self._on_idle()
        else:
            loop = asyncio.get_running_loop()
            self._idle_timer = loop.call_later(idle_s - quiet, self._check_idle)


async def _pump(
    prompt: int,
    stream: AsyncIterator[TokenChunk],
    queue: asyncio.Queue[Item],
    pumped: Callable[[], bool],
) -> None:
    try:
        async for event in stream:
            queue.put_nowait((prompt, event))
            if not pumped():
                return
        queue.put_nowait((prompt, END))
    except Exception as e:
        queue.put_nowait((prompt, e))
