"""How ``auto``'s step costs are measured: the target's pass by width, on a real engine, with the clock injected so
that another process's load can be scripted (no timing is asserted; the clock is the test's)."""

from __future__ import annotations

import pytest

from specdec_edge import Pipeline
from specdec_edge.api.step_costs import WIDTHS, measure_verify


class LoadedClock:
    """A clock that advances only when the engine runs: a pass of w rows takes ``cost(w)``, and the passes with
    numbers in ``burst`` take ``extra`` more (another process holding the CPU for a while)."""

    def __init__(self, engine, burst: range, extra: float):
        self.now, self.calls, self.burst, self.extra = 0.0, 0, burst, extra
        self.engine, self._run = engine, engine.run
        engine.run = self.run

    @staticmethod
    def cost(width: int) -> float:
        return 1e-3 * (1.0 + 0.1 * (width - 1))

    def run(self, ids, *args, **kwargs):
        out = self._run(ids, *args, **kwargs)
        self.now += self.cost(len(ids)) + (self.extra if self.calls in self.burst else 0.0)
        self.calls += 1
        return out

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def engine(tiny_bundle):
    pipe = Pipeline.load(tiny_bundle, method="plain", threads=1)
    yield pipe.engines.target
    pipe.close()


@pytest.mark.parametrize("start", [2, 9, 20, 33])
def test_a_burst_of_load_does_not_bend_the_cost_curve(engine, start):
    """A burst as long as a whole round of widths, wherever it falls, leaves every width its true cost: the widths
    are timed in interleaved rounds and each keeps its least time. (Consecutive medians let such a burst price
    a few neighbouring widths several times dearer, which stayed in the cache and steered ``auto`` off them.)"""
    widths = WIDTHS[:8]
    clock = LoadedClock(engine, range(start, start + len(widths)), extra=5e-3)
    contexts, seconds = measure_verify(engine, widths=widths, contexts=(16,), clock=clock)
    assert contexts == [16] and clock.calls >= 2 * 3 * len(widths)  # at least 3 rounds of (untimed, timed) runs
    assert seconds[0] == pytest.approx([LoadedClock.cost(w) for w in widths], rel=1e-9)
    assert engine.length == 0  # the measurement leaves the cache empty


def test_load_in_every_round_still_gives_a_nondecreasing_curve(engine):
    """Where every round is disturbed the curve is what the least times allow, made nondecreasing (a wider pass
    never costs less): no width priced below a narrower one."""
    widths = WIDTHS[:6]
    clock = LoadedClock(engine, range(0, 10**6, 5), extra=3e-3)  # every fifth pass, across all rounds
    _, seconds = measure_verify(engine, widths=widths, contexts=(16,), rounds=(2, 2), clock=clock)
    row = seconds[0]
    assert row == sorted(row)
    assert all(s >= LoadedClock.cost(w) - 1e-12 for s, w in zip(row, widths))


class EasingClock(LoadedClock):
    """Load that eases off round after round: every pass of round r (2 x widths passes) takes ``0.7 ** r`` ms more."""

    def __init__(self, engine, widths: int):
        super().__init__(engine, range(0), 0.0)
        self.per_round = 2 * widths

    def run(self, ids, *args, **kwargs):
        out = self._run(ids, *args, **kwargs)
        self.now += self.cost(len(ids)) + 1e-3 * 0.7 ** (self.calls // self.per_round)
        self.calls += 1
        return out


def test_a_steady_machine_stops_after_the_least_rounds_and_a_noisy_one_goes_on(engine):
    widths = WIDTHS[:5]
    steady = LoadedClock(engine, range(0), 0.0)
    measure_verify(engine, widths=widths, contexts=(16,), rounds=(3, 8), clock=steady)
    assert 2 * 3 * len(widths) <= steady.calls < 2 * 4 * len(widths)
    engine.run = steady._run
    easing = EasingClock(engine, len(widths))
    _, seconds = measure_verify(engine, widths=widths, contexts=(16,), rounds=(3, 8), clock=easing)
    assert easing.calls >= 2 * 8 * len(widths)  # every round still lowered the times: all 8 were run
    assert all(s < LoadedClock.cost(w) + 1e-3 * 0.7**6 for s, w in zip(seconds[0], widths))


def test_a_context_measured_under_load_is_capped_by_the_longer_one(engine):
    """Load through the whole of the short context's rounds: its curve cannot be trusted, but a pass after fewer
    cached tokens never costs more than after more, so the longer context's clean curve caps it."""
    widths = WIDTHS[:5]
    first_block = 2 + 2 * 4 * len(widths)  # prefill, warm-up, then 4 rounds of (untimed, timed) runs
    clock = LoadedClock(engine, range(0, first_block), extra=4e-3)
    contexts, seconds = measure_verify(engine, widths=widths, contexts=(48, 16), rounds=(4, 8), clock=clock)
    assert contexts == [16, 48]
    true = [LoadedClock.cost(w) for w in widths]
    assert seconds[1] == pytest.approx(true, rel=1e-9) and seconds[0] == pytest.approx(true, rel=1e-9)
