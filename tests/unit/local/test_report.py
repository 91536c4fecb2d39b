"""The report's iteration breakdown shows the warm-up apart from the steady state it would flatten."""

from __future__ import annotations

from bagpipe.local.report import warm_up


def test_the_warm_up_is_the_slow_start_and_at_least_the_first_batch() -> None:
    steady = [0.02] * 200
    assert warm_up([3.0, 0.6, 0.2, *steady]) == 3  # start-up, the first plans, compiling
    assert warm_up([0.021, *steady]) == 1  # (no slow start: the first batch alone)
    assert warm_up([3.0, *steady[:50], 0.5, *steady[:50]]) == 1  # a slow batch later is not warm-up
    assert warm_up([0.5]) == 0 and warm_up([]) == 0
