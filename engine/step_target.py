"""The engine's step-sizing part: the TPOT target a step carrying decodes should meet, the
step-time model that predicts steps (engine/step_model.py), the scheduler's cap made of the two
(``PrefillCap``), and what each step that ran adds to the model and to the metrics
(engine/step_stats.py).

The target: ``SchedulerConfig.tpot_target_s``; by default (None) ``DEFAULT_TPOT_TARGET_S``, or
twice what a lone decode step takes here when that is longer (a target a single stream cannot
meet would leave prompts only the age bound); <= 0: no target, no model, no cap.
"""

from __future__ import annotations

import logging

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.prefill_cap import PrefillCap
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.step_budget import StepBudget
from pdserve.engine.step_model import StepModel, calibrate_step_model
from pdserve.engine.step_stats import StepStats
from pdserve.protocol.control import StepCounters

logger = logging.getLogger(__name__)

DEFAULT_TPOT_TARGET_S = 0.05
AUTO_DECODE_FACTOR = 2.0  # auto target: at least this many lone decode steps


class StepTarget:
    """``target_s`` (0: none) and ``model`` (None without a target); ``stats`` of every step."""

    def __init__(
        self,
        target_s: float,
        model: StepModel | None,
        age_bound_s: float,
        overdue_tokens: int = 16,
    ) -> None:
        self.target_s = target_s if model is not None else 0.0
        self.model = model
        self.age_bound_s = age_bound_s
        self.overdue_tokens = overdue_tokens  # a block: what overdue prompts take past the cap
        self.stats = StepStats()

    @classmethod
    def calibrate(
        cls,
        config: SchedulerConfig,
        runner: ModelRunner,
        blocks: BlockManager,
        max_model_len: int,
        budget: StepBudget | None,
    ) -> StepTarget:
        """Measure the model (reusing ``budget``'s prefill probes) and settle the target."""
        wanted = config.tpot_target_s
        if wanted is not None and wanted <= 0:
            return cls(0.0, None, config.prefill_age_bound_s, blocks.block_size)
        probes = budget.probes if budget is not None else ()
        model = calibrate_step_model(
            runner, blocks, max_model_len, config.max_num_seqs, prefill_probes=probes
        )
        target = wanted if wanted is not None else auto_target(model)
        lone = model.costs.seconds(0, 1)
        logger.info(
            "TPOT target %.0f ms (%s): a lone decode step takes %.1f ms here, leaving room "
            "for %d prompt tokens beside it",
            target * 1e3,
            "set" if wanted is not None else "auto",
            lone * 1e3,
            model.costs.prefill_room(1, target),
        )
        if lone > target:
            logger.warning(
                "a lone decode step (%.1f ms) is over the %.0f ms TPOT target: prompts beside "
                "running streams wait for the age bound (%.1f s)",
                lone * 1e3,
                target * 1e3,
                config.prefill_age_bound_s,
            )
        return cls(target, model, config.prefill_age_bound_s, blocks.block_size)

    def cap(self) -> PrefillCap | None:
        """The scheduler's rule; None without a target."""
        if self.model is None:
            return None
        model, target = self.model, self.target_s
        return PrefillCap(
            lambda d: model.costs.prefill_room(d, target), self.age_bound_s, self.overdue_tokens
        )

    def observe(self, batch: ScheduledBatch, seconds: float) -> None:
        """A step that ran: into the metrics, with why it ran over the target if it did, and
        into the model."""
        prefill, decodes = batch.prefill_tokens, batch.decode_seqs
        reason = None
        if self.model is not None:
            if decodes and seconds > self.target_s:
                reason = self._why_over(prefill, decodes, batch.overdue_tokens)
            # a verification's drafts are priced as prompt tokens (engine/spec/policy.py)
            self.model.observe(prefill + batch.spec_slots, decodes, seconds)
        self.stats.record(prefill, decodes, seconds, reason)

    def _why_over(self, prefill: int, decodes: int, overdue: int) -> str:
        assert self.model is not None
        if self.model.costs.seconds(0, decodes) > self.target_s:
            return "decodes"
        return "age_bound" if overdue else "misprediction"

    def counters(self) -> StepCounters:
        terms = self.model.costs.terms() if self.model is not None else []
        return self.stats.counters(self.target_s, terms)


def auto_target(model: StepModel) -> float:
    """The default target: ``DEFAULT_TPOT_TARGET_S``, or ``AUTO_DECODE_FACTOR`` lone decode
    steps when that is longer."""
    return max(DEFAULT_TPOT_TARGET_S, AUTO_DECODE_FACTOR * model.costs.seconds(0, 1))
