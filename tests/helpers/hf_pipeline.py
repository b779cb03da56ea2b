"""Shared by the unit and integration tests of hf pipeline."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


# float64: the tied weight's gradient summed over two stages, one process's in autograd's order
TIED_TOLERANCE = 1e-15
