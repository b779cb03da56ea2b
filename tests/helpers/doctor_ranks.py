"""Shared by the unit and integration tests of doctor ranks."""

from __future__ import annotations

GIB = 1 << 30


RANK1 = "rank 1 (pp 0, dp 1, cp 0, tp 0)"
