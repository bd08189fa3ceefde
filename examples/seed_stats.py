"""Seed noise: mean ± standard deviation over seeds, and whether a difference between two models exceeds it.

Runs of two models with the same seed see the same batches in the same order
(and, when their parameters have the same shapes, start from the same
weights), so the comparison pairs them by seed: the difference is measured
per seed, and its mean is significant when the 95% Student-t interval around
it excludes zero.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

# Two-sided 95% quantiles of Student's t, by degrees of freedom (n seeds - 1).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (NaN for one value)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


@dataclasses.dataclass
class Difference:
    """``model - baseline`` of a loss (lower is better) over the seeds both have: mean, std, the 95% half-width."""

    mean: float
    std: float
    n: int
    half_width: float

    @property
    def significant(self) -> bool:
        """The 95% interval of the mean difference excludes zero (needs at least two seeds)."""
        return self.n >= 2 and abs(self.mean) > self.half_width

    def verdict(self) -> str:
        if self.n < 2:
            return "one seed: noise unknown"
        if not self.significant:
            return "within seed noise"
        return "better, beyond seed noise" if self.mean < 0 else "worse, beyond seed noise"


def paired_difference(model: dict[int, float], baseline: dict[int, float]) -> Difference:
    """The difference of two ``{seed: loss}`` maps over their common seeds."""
    seeds = sorted(set(model) & set(baseline))
    diffs = [model[s] - baseline[s] for s in seeds]
    mean, std = mean_std(diffs)
    n = len(diffs)
    half = T_975.get(n - 1, 1.96) * std / math.sqrt(n) if n >= 2 else math.nan
    return Difference(mean, std, n, half)


def format_mean_std(mean: float, std: float, signed: bool = False) -> str:
    """``mean ± std`` to four decimals (just the mean when std is NaN); ``signed`` writes a + before a gain."""
    if math.isnan(mean):
        return "-"
    text = f"{mean:+.4f}" if signed else f"{mean:.4f}"
    return text if math.isnan(std) else f"{text} ± {std:.4f}"
