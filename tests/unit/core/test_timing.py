"""remat.core.timing: the spread that tells a real step-time difference from noise."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from remat.core.timing import spread


@pytest.mark.parametrize(
    "times, expected",
    [([], 0.0), ([1.0], 0.0), ([1.0, 3.0], 1.0), ([1.0, 2.0, 5.0], 2.0), ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0], 2.0)],
)
def test_spread(times, expected) -> None:
    assert spread(times) == pytest.approx(expected)


@given(st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=7, max_size=20), st.floats(1e3, 1e6))
def test_one_stray_slow_step_in_eight_leaves_the_spread_within_the_others(times, stray) -> None:
    assert spread([*times, stray]) <= (max(times) - min(times)) / 2
