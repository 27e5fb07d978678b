"""CounterWindow: the increase of a counter over a sliding window, restarts and bounded memory."""

from __future__ import annotations

import pytest

from detector.core.rates import CounterWindow, Increase


def test_first_sample_has_no_increase():
    w = CounterWindow(600)
    assert w.add("a", 5, now=0) is None


def test_increase_spans_the_window_once_watched_that_long():
    w = CounterWindow(600)
    for t in range(0, 1201, 60):                       # +1 per minute for 20 minutes
        inc = w.add("a", t // 60, now=t)
    assert inc == Increase(10, 600)                    # only the last ten minutes count
    assert inc.per_min() == pytest.approx(1.0)


def test_short_history_reports_its_real_span():
    w = CounterWindow(600)
    w.add("a", 0, now=0)
    inc = w.add("a", 30, now=60)
    assert inc == Increase(30, 60) and inc.per_s() == pytest.approx(0.5)


def test_a_counter_that_goes_down_starts_afresh():
    w = CounterWindow(600)
    w.add("a", 1000, now=0)
    w.add("a", 1010, now=60)
    assert w.add("a", 3, now=120) is None              # reset: no negative rate, no stale baseline
    assert w.add("a", 5, now=180) == Increase(2, 60)


def test_time_counter_as_fraction():
    w = CounterWindow(600)
    w.add("slowdown", 0, now=0)
    inc = w.add("slowdown", 150e9, now=600)            # 150 s of throttling in 600 s
    assert inc.fraction(1e9) == pytest.approx(0.25)


def test_keys_are_independent_and_can_be_forgotten():
    w = CounterWindow(600)
    w.add(("gpu0", 1), 0, now=0)
    w.add(("gpu1", 1), 0, now=0)
    assert w.add(("gpu0", 1), 7, now=10) == Increase(7, 10)
    w.keep_only({("gpu0", 1)})
    assert w.increase(("gpu1", 1)) is None
    assert w.increase(("gpu0", 1)) == Increase(7, 10)


def test_samples_stay_bounded():
    w = CounterWindow(600)
    for t in range(0, 100_000, 10):
        w.add("a", t, now=t)
    assert len(w._samples["a"]) <= 62
