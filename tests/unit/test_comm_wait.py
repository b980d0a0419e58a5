"""A polled wait (zerompi/comm/base.py Handle.wait: a timeout, an idle hook or chains in
flight) notices its collective's end soon after it happens, on a clock of the test's own:
the sleeps between tests never add more than a tenth of the wait (doubling alone added up
to all of it), and a long wait wakes at most ~100 times a second."""
import pytest

from zerompi.comm import base


class FakeClock:
    def __init__(self):
        self.now, self.sleeps = 0.0, 0

    def perf_counter(self):
        return self.now

    def sleep(self, s):
        self.sleeps += 1
        self.now += s


@pytest.mark.parametrize("done_at", [1e-5, 3e-4, 1.3e-3, 2e-3, 0.011, 0.05, 1.0, 30.0])
@pytest.mark.parametrize("how", ["timeout", "idle"])
def test_a_polled_wait_ends_within_a_tenth_of_its_collective(monkeypatch, done_at, how):
    clock = FakeClock()
    monkeypatch.setattr(base, "time", clock)
    tests = []

    def test_fn():
        tests.append(clock.now)
        return clock.now >= done_at

    h = base.Handle(base.CommStats(), "all_gather", wait_fn=lambda: pytest.fail("blocked instead of polling"),
                    test_fn=test_fn, idle=(lambda: None) if how == "idle" else None)
    h.wait(timeout=3600.0 if how == "timeout" else None)
    assert h.done and tests[-1] >= done_at
    assert clock.now <= 1.1 * done_at + 1e-5, (done_at, clock.now)  # doubling alone: up to 2x
    assert clock.sleeps <= 100 + done_at / 1e-2, clock.sleeps         # capped at 10 ms a sleep


def test_the_pause_doubles_from_10us_and_stays_short_while_chains_run():
    assert base.next_pause(1e-5, 1.0, chains=False) == 2e-5
    assert base.next_pause(4e-3, 1.0, chains=False) == 8e-3
    assert base.next_pause(8e-3, 100.0, chains=False) == 1e-2
    assert base.next_pause(8e-3, 100.0, chains=True) == 2e-4
    assert base.next_pause(1e-3, 2e-3, chains=False) == pytest.approx(2e-4)
