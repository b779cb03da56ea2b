"""How much step times vary: what tells a real difference from noise."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def spread(times: Sequence[float]) -> float:
    """Half the interquartile range of `times` (half the range below four of them): how far a
    typical step strays from the median, robust to a stray slow step."""
    if len(times) < 2:
        return 0.0
    if len(times) < 4:
        return (max(times) - min(times)) / 2
    low, _, high = statistics.quantiles(times, n=4)
    return (high - low) / 2
