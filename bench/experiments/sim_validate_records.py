"""The validation's records: each figure real against simulated with its error and aim, each
comparison's winners, and their summary (sim_validate.py fills them, sim_validate_report.py
shows them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any  # the report is JSON

AIM_P50, AIM_TAIL = 0.15, 0.25
TAIL_MARKS = ("_p90_", "_p99_", "_max_", "goodput", "attainment")
Json = dict[str, Any]


def aim(figure: str) -> float:
    """15% for medians and single durations, 25% for tails (p90, p99, max) and goodput."""
    return AIM_TAIL if any(m in figure for m in TAIL_MARKS) else AIM_P50


def best(figures: Mapping[str, float], better: str) -> str:
    """The arm whose figure is the highest (``better`` "higher") or the lowest."""
    pick = max if better == "higher" else min
    return pick(figures, key=lambda arm: figures[arm])


class Report:
    """The figures and comparisons as they are found, and each experiment's notes."""

    def __init__(self) -> None:
        self.experiments: dict[str, Json] = {}
        self.figures: list[Json] = []
        self.comparisons: list[Json] = []
        self.variants: dict[str, Any] = {}

    def figure(
        self,
        exp: str,
        case: str,
        name: str,
        real: float,
        rounds: Sequence[float],
        sim: float,
        uncalibrated: float,
    ) -> None:
        error = (sim - real) / real if real else float("inf")
        self.figures.append(
            {
                "experiment": exp,
                "case": case,
                "figure": name,
                "real": real,
                "real_rounds": list(rounds),
                "sim": sim,
                "sim_uncalibrated": uncalibrated,
                "error": error,
                "error_uncalibrated": (uncalibrated - real) / real if real else float("inf"),
                "aim": aim(name),
                "within": abs(error) <= aim(name),
            }
        )

    def compare(
        self,
        exp: str,
        case: str,
        name: str,
        better: str,
        real: dict[str, float],
        real_rounds: Mapping[str, Sequence[float]] | None,
        sim: dict[str, float] | None,
    ) -> None:
        """Which of the arms in ``real`` wins on ``name`` (``better``: higher or lower), in the
        real medians, in each real round alone, and in the simulator (None: not replayed)."""
        winner = best(real, better)
        rounds_agree = None
        if real_rounds:
            count = len(next(iter(real_rounds.values())))
            each = [best({a: v[i] for a, v in real_rounds.items()}, better) for i in range(count)]
            rounds_agree = all(w == winner for w in each)
        sim_winner = None if sim is None else best(sim, better)
        self.comparisons.append(
            {
                "experiment": exp,
                "case": case,
                "figure": name,
                "better": better,
                "arms": list(real),
                "real": real,
                "sim": sim,
                "real_winner": winner,
                "real_rounds_agree": rounds_agree,
                "sim_winner": sim_winner,
                "same": None if sim is None else sim_winner == winner,
            }
        )

    def to_json(self) -> Json:
        """The figures, comparisons, experiments' notes and variants, and their summary."""
        figs, comps = self.figures, [c for c in self.comparisons if c["same"] is not None]
        by_exp = {
            exp: {
                "figures": sum(f["experiment"] == exp for f in figs),
                "within": sum(f["within"] for f in figs if f["experiment"] == exp),
                "within_uncalibrated": sum(
                    abs(f["error_uncalibrated"]) <= f["aim"] for f in figs if f["experiment"] == exp
                ),
            }
            for exp in self.experiments
        }
        robust = [c for c in comps if c["real_rounds_agree"]]
        summary = {
            "figures": len(figs),
            "within": sum(f["within"] for f in figs),
            "within_uncalibrated": sum(abs(f["error_uncalibrated"]) <= f["aim"] for f in figs),
            "p50_class": _within(figs, AIM_P50),
            "tail_class": _within(figs, AIM_TAIL),
            "by_experiment": by_exp,
            "comparisons": len(comps),
            "same_winner": sum(c["same"] for c in comps),
            "robust_comparisons": len(robust),
            "robust_same_winner": sum(c["same"] for c in robust),
            "not_replayed_comparisons": len(self.comparisons) - len(comps),
        }
        return {
            "summary": summary,
            "experiments": self.experiments,
            "figures": self.figures,
            "comparisons": self.comparisons,
            "variants": self.variants,
        }


def _within(figs: list[Json], aim_: float) -> list[int]:
    """[within, of] the figures of one aim."""
    chosen = [f for f in figs if f["aim"] == aim_]
    return [sum(f["within"] for f in chosen), len(chosen)]
