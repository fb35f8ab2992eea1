"""`kvmesh up --autoscale`: the decider's hysteresis, and a live stack (tiny model) whose
prefill pool grows under load and shrinks after it, every request answered."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import openai
import pytest

from kvmesh.autoscale import Decider, Hysteresis, bounds
from tests.kvmesh.test_up import KVMESH
from tests.procs import Proc, free_port, service_env, wait_until


def test_bounds_are_min_colon_max_within_1_and_64() -> None:
    assert bounds("1:4") == (1, 4)
    for bad in ("4", "0:2", "3:2", "1:65", "a:b"):
        with pytest.raises(ValueError, match="--autoscale"):
            bounds(bad)


def test_a_pool_grows_after_two_looks_asking_more_and_shrinks_one_at_a_time() -> None:
    d = Decider(1, 8, Hysteresis(up_after=2, down_after=3, cooldown_s=10))
    assert d.decide("prefill", 5, 1, now=0) == 1  # once: not yet
    assert d.decide("prefill", 5, 1, now=1) == 5  # twice in a row: straight to the plan's
    assert d.decide("prefill", 1, 5, now=2) == 5  # (cooling down: the look counts)
    assert d.decide("prefill", 1, 5, now=9) == 5  # (still)
    assert d.decide("prefill", 1, 5, now=12) == 4  # the third look asking fewer: one less
    assert d.decide("prefill", 1, 4, now=13) == 4
    assert d.decide("prefill", 20, 4, now=30) == 4
    assert d.decide("prefill", 20, 4, now=31) == 8  # (at most MAX)


def test_a_plan_that_flaps_moves_nothing() -> None:
    d = Decider(1, 8, Hysteresis(up_after=2, down_after=3, cooldown_s=0))
    sizes = [d.decide("decode", want, 2, now=t) for t, want in enumerate([3, 1, 3, 1, 3, 2, 1])]
    assert sizes == [2] * 7


def test_a_pool_outside_the_bounds_is_moved_in_at_once() -> None:
    d = Decider(2, 4)
    assert d.decide("decode", 1, 1, now=0) == 2
    assert d.decide("decode", 9, 6, now=1) == 4


PROMPT = " ".join(f"berth{i}" for i in range(150))  # ~300 tokens, all to prefill


def test_load_grows_the_prefill_pool_and_its_end_drains_it_back(state_dir: Path) -> None:
    """Three clients keep one tiny prefill worker queueing past the TTFT target: the plan asks
    for two, a second worker starts and takes requests. The load stops: the window empties,
    the plan asks for one, the second is drained and stopped. Every request is answered."""
    http_port = free_port()
    env = service_env(
        f"nats://127.0.0.1:{free_port()}",
        state_dir,
        KVMESH_ROUTER_HTTP_PORT=str(http_port),
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",
        KVMESH_ROUTER_PLAN_WINDOW_S="12",
        KVMESH_ROUTER_PLAN_TTFT_P50_S="0.02",
        KVMESH_ROUTER_PLAN_TTFT_P99_S="0.05",
        KVMESH_ROUTER_PLAN_TPOT_MEAN_S="1",
    )
    args = ["up", "--encoder", "0", "--autoscale", "1:2", "--autoscale-every", "1"]
    up = Proc([*KVMESH, *args], env, state_dir / "up.log")
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=4, timeout=60
    )  # (as a user's client: a 429 while a worker loads its model on two cores is retried)
    stop, answers, errors = threading.Event(), [], []

    def load(k: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                done = client.completions.create(
                    model="tiny", prompt=f"{k}-{i} {PROMPT}", max_tokens=4, temperature=0
                )
                assert done.usage.completion_tokens == 4
                answers.append(done.model_extra["kvmesh"]["workers"])
            except Exception as err:  # noqa: BLE001 (a lost request: the test fails on it)
                errors.append(err)

    threads = [threading.Thread(target=load, args=(k,)) for k in range(3)]
    try:
        up.wait_for("kvmesh is up", 120)
        for t in threads:
            t.start()
        up.wait_for("autoscale: prefill 1 → 2", 90)
        wait_until(
            lambda: any("prefill-1" in w for w in answers), 60, what="prefill-1 taking requests"
        )
        stop.set()
        for t in threads:
            t.join(60)
        up.wait_for("autoscale: prefill 2 → 1", 90)
        up.wait_for("autoscale: prefill-1 drained and stopped", 60)
        assert not errors, errors[:3]
        assert len(answers) >= 10
        assert "decode 1 → 2" not in up.output()  # (its target is far: it never grew)
        up.signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        stop.set()
        up.stop()
