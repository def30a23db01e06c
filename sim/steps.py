"""How long a simulated worker's step takes, from its ``Profile`` (measured or derived).

    prefill(n)        profile.prefill_seconds(n): a step of n prompt tokens, however many
                      prompts they come from (their attention over each other is not split out)
    decode(b, c)      profile.decode_step_seconds(b, c), c the batch's mean context
    mixed(n, b, c)    decode(b, c) + prefill(n) − min(prefill(n), decode(1, 0)): one step reads
                      the weights once, so the part of a prompt chunk's time that a lone decode
                      step also spends (weights, dispatch) is not paid twice; on a CPU worker this
                      is the engine's own step model (fixed + per token·P + per sequence·D)

The stall-free room (engine/step_model.py's ``prefill_room``): the most prompt tokens a step
of b decodes may add and stay within the TPOT target; the step budget
(engine/step_budget.py): the most tokens one step may take within ``max_step_time_s``, whole
blocks. The simulator predicts with the same figures it then spends, so a step never runs over
its prediction (the real engine's model does: its ``misprediction`` count)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from pdserve.coordinator.profile import Profile

DEFAULT_TPOT_TARGET_S = 0.05  # engine/step_target.py's
AUTO_DECODE_FACTOR = 2.0


class StepTimes:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.block_size = profile.block_size
        self._lone = profile.decode_step_seconds(1, 0)
        self.prefill = functools.lru_cache(maxsize=1 << 16)(profile.prefill_seconds)
        self._decode = functools.lru_cache(maxsize=1 << 16)(self._decode_at)

    def _decode_at(self, batch: int, context_blocks: int) -> float:
        return self.profile.decode_step_seconds(batch, context_blocks * self.block_size)

    def decode(self, batch: int, context: float) -> float:
        # contexts to the nearest block: the profile is piecewise linear, a block is noise
        return self._decode(batch, int(context) // self.block_size)

    def mixed(self, prompt_tokens: int, batch: int, context: float) -> float:
        """Seconds of a step of ``prompt_tokens`` and ``batch`` decodes of mean ``context``."""
        if batch <= 0:
            return self.prefill(prompt_tokens)
        step = self.decode(batch, context)
        if prompt_tokens <= 0:
            return step
        chunk = self.prefill(prompt_tokens)
        return step + chunk - min(chunk, self._lone)

    def budget_tokens(self, max_tokens: int, max_step_time_s: float) -> int:
        """The most tokens a step may take: ``max_tokens``, lowered to whole blocks that run
        within ``max_step_time_s`` (<= 0: no time budget); a block at least."""
        if max_step_time_s <= 0 or self.prefill(max_tokens) <= max_step_time_s:
            return max_tokens
        fit = self._largest(lambda n: self.prefill(n) <= max_step_time_s, max_tokens)
        fit = fit // self.block_size * self.block_size
        return max(min(self.block_size, max_tokens), fit)

    def tpot_target(self, wanted_s: float | None) -> float:
        """The target a step carrying decodes keeps to (engine/step_target.py): ``wanted_s``;
        None: the default, or twice a lone decode step where that is longer; <= 0: none."""
        if wanted_s is None:
            return max(DEFAULT_TPOT_TARGET_S, AUTO_DECODE_FACTOR * self._lone)
        return max(0.0, wanted_s)

    def room(self, batch: int, context: float, target_s: float, most: int) -> int:
        """Prompt tokens a step of ``batch`` decodes may add within ``target_s`` (at most
        ``most``)."""
        if most <= 0 or self.mixed(1, batch, context) > target_s:
            return 0
        if self.mixed(most, batch, context) <= target_s:
            return most
        return self._largest(lambda n: self.mixed(n, batch, context) <= target_s, most)

    @staticmethod
    def _largest(fits: Callable[[int], bool], most: int) -> int:
        """The largest n in [1, most] with ``fits(n)`` (monotone; 0 when ``fits(1)`` fails)."""
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo
