"""95% intervals of a mean over repeated measurements (runs, rounds, cases), for the figures' bands."""

from __future__ import annotations

import math
import statistics

# Student's t, two-sided 95%, by degrees of freedom (1-30); past 30 the normal's 1.96 is within 4%
T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): Student's t interval of the mean; low = high = mean where one value gives no spread."""
    if not values:
        raise ValueError("mean_interval: no values")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    t = T_975[len(values) - 2] if len(values) - 1 <= len(T_975) else 1.96
    half = t * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half
