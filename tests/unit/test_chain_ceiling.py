"""benchmarks/chain_ceiling.py's arithmetic: what a drafted chain can gain from a device's step costs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from specdec_edge.speculative.costs import CostModel

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "chain_ceiling.py"


@pytest.fixture(scope="module")
def ceiling():
    spec = importlib.util.spec_from_file_location("chain_ceiling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def curve(per_row: float) -> CostModel:
    """A pass of w rows costs 1 + per_row * (w - 1) one-row passes (10 ms each)."""
    widths = list(range(1, 9))
    return CostModel(widths, [64], [[0.01 * (1 + per_row * (w - 1)) for w in widths]])


def test_a_chain_pays_by_its_accepted_tokens_over_its_rows(ceiling):
    model = curve(0.2)
    # every draft accepted, three of them: 4 tokens for a 4-row pass (1.6) and three head runs of 0.5 ms
    expected = 4 * 1.03 / (1.6 + 3 * 0.05 + 0.03)
    assert ceiling.speedup(model, 64, 1.0, 3, 0.0005, 0.03) == pytest.approx(expected)
    assert ceiling.speedup(model, 64, 1.0, 3, 0.0005, 0.03, flat=True) == pytest.approx(4 * 1.03 / 1.18)
    assert ceiling.speedup(model, 64, 0.0, 1, 0.0, 0.03) < 1  # nothing accepted: the row is lost


def test_the_acceptance_a_target_needs(ceiling):
    model = curve(0.2)
    need = ceiling.needed(model, 64, 1.6, 0.0005, 0.03)
    best = max(ceiling.speedup(model, 64, need, d, 0.0005, 0.03) for d in ceiling.DEPTHS)
    below = max(ceiling.speedup(model, 64, need - 0.01, d, 0.0005, 0.03) for d in ceiling.DEPTHS)
    assert 0.5 < need < 1 and best == pytest.approx(1.6, abs=1e-6) and below < 1.6
    # rows as dear as whole passes: no chain reaches 1.6x, even with every draft accepted
    assert ceiling.needed(curve(1.0), 64, 1.6, 0.0005, 0.03) is None
