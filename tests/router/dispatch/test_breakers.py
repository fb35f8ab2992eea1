"""Circuit breakers on a clock the test turns: faults in a row open one, a cool-down half
opens it for one trial, whose success closes it and whose fault opens it again."""

from __future__ import annotations

from services.router.dispatch.workers import OPEN, Breakers


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gauge(worker: str) -> float:
    return OPEN.labels(worker)._value.get()


def test_faults_in_a_row_open_it_and_a_success_between_them_resets_the_count() -> None:
    clock = Clock()
    b = Breakers(threshold=3, cooldown_s=10, clock=clock)

    def fault(why: str) -> None:
        clock.now += 1
        b.fault("w", why)

    fault("no ack")
    fault("no ack")
    b.success("w")  # not in a row: counting starts again
    fault("no ack")
    fault("no ack")
    assert b.state("w") == "closed" and b.allows("w")
    fault("gone")
    assert b.state("w") == "open" and not b.allows("w")
    assert gauge("w") == 1
    assert b.allows("other")  # one worker's breaker only


def test_faults_at_once_are_one_incident() -> None:
    """A worker that dies fails every request it holds in the same instant: one fault."""
    clock = Clock()
    b = Breakers(threshold=2, cooldown_s=10, clock=clock)
    for _ in range(5):
        b.fault("w", "went away")
        clock.now += 0.01
    assert b.state("w") == "closed"
    clock.now += 1
    b.fault("w", "went away")
    assert b.state("w") == "open"


def test_after_the_cool_down_one_trial_decides() -> None:
    clock = Clock()
    b = Breakers(threshold=1, cooldown_s=10, clock=clock)
    b.fault("w", "gone")
    clock.now += 9.9
    assert not b.allows("w")
    clock.now += 0.1
    assert b.state("w") == "half_open" and b.allows("w")
    b.trying("w")
    assert not b.allows("w")  # one trial at a time
    clock.now += 1
    b.fault("w", "gone again")  # the trial failed: open for another cool-down
    assert b.state("w") == "open"
    clock.now += 10
    b.trying("w")
    b.success("w")
    assert b.state("w") == "closed" and b.allows("w") and gauge("w") == 0


def test_a_trial_that_neither_fails_nor_succeeds_lapses() -> None:
    """A busy refusal is no fault and no success: the next request may try after a cool-down."""
    clock = Clock()
    b = Breakers(threshold=1, cooldown_s=5, clock=clock)
    b.fault("w", "gone")
    clock.now += 5
    b.trying("w")
    clock.now += 4
    assert not b.allows("w")
    clock.now += 1
    assert b.allows("w")
