"""The dispatcher in-process, against a real nats-server (one for the module) and scripted
workers: answers in order and merged, busy and silent workers skipped, the watchdog's bounds,
moves before and after the first token (resumed with no token missing or repeated), breakers,
cancellation, errors and deadlines. Each in well under a second."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from services.router.dispatch.dispatcher import Dispatcher
from services.router.dispatch.job import Job
from services.router.dispatch.kvindex import RouterIndex
from services.router.dispatch.workers import Breakers, WorkerRegistry
from services.router.errors import ApiError
from services.router.routing.policies import POLICIES
from services.router.settings import DispatchSettings, WorkerSettings
from shared.bus import Bus
from shared.messages.generate import GenerateTask, TaskAck
from shared.messages.kvevents import KvEvent, memory_location
from shared.messages.sampling import SamplingParams
from tests.procs import until
from tests.router.dispatch.scripted import Script, ScriptedWorker, busy, silent, tokens

ANSWER = list(range(100, 108))  # the scripted workers' answer: 8 tokens
POISON = 99_999  # a token the poisoned prompts hold
FAST = DispatchSettings(
    ack_timeout_s=0.2,
    first_token_timeout_s=0.3,
    token_timeout_s=0.3,
    liveness_check_s=0.02,
    local_prefill_max_tokens=0,
    migration_limit=2,
)
_ids = itertools.count()


@pytest.fixture(scope="module")
async def bus(open_nats_url: str) -> AsyncIterator[Bus]:
    bus = await Bus.connect(open_nats_url, "test-dispatch", 10)
    yield bus
    await bus.close()


class Mesh:
    """A router's dispatch (its own id, registry and breakers) and the test's workers."""

    def __init__(
        self, bus: Bus, settings: DispatchSettings, clock: list[float], secrets: Path
    ) -> None:
        self.bus = bus
        self.tag = f"t{next(_ids)}"
        self.registry = WorkerRegistry()
        self.breakers = Breakers(threshold=3, cooldown_s=10.0, clock=lambda: clock[0])
        self.policy = POLICIES["ttft"]()
        # The router's block index, not following a stream: a test applies events to it.
        self.kv = RouterIndex(f"router-{self.tag}", 0.0, self.registry, WorkerSettings(), 1.0)
        self.dispatcher = Dispatcher(
            bus,
            f"router-{self.tag}",
            self.registry,
            self.breakers,
            self.kv,
            self.policy,
            settings,
            secrets,
        )
        self.workers: dict[str, ScriptedWorker] = {}

    async def worker(self, role: str, name: str, script: Script) -> ScriptedWorker:
        w = ScriptedWorker(self.bus, role, f"{name}-{self.tag}", script)
        await w.start(self.registry)
        self.workers[name] = w
        return w

    def id(self, name: str) -> str:
        return f"{name}-{self.tag}"

    async def answer(self, job: Job, decision: dict | None = None) -> list:
        return [e async for e in self.dispatcher.generate(job, decision)]

    def tokens(self, events: list) -> list[int]:
        return [t for e in events for t in e.token_ids]

    def settled(self) -> None:
        """Nothing left counted in flight anywhere."""
        assert self.dispatcher.inflight.requests == {}
        assert not self.dispatcher.replies.waiting
        for state in self.policy.workers.values():
            state.check_integrity()
            assert state.inflight == 0


@pytest.fixture
async def mesh(bus: Bus, tmp_path: Path) -> AsyncIterator[Mesh]:
    m = Mesh(bus, FAST, [0.0], tmp_path)
    await m.dispatcher.start()
    yield m
    await m.dispatcher.stop()


def contiguous(events: list) -> bool:
    """Each event starts where the one before it ended (merged ones included)."""
    at = 0
    for e in events:
        if e.index != at:
            return False
        at += len(e.token_ids)
    return True


def job(n_prompt: int = 100, max_tokens: int = 8, deadline_s: float = 30.0) -> Job:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0)
    prompt = list(range(n_prompt))
    return Job(uuid.uuid4().hex, "tiny", prompt, sampling, time.time() + deadline_s)


def together(answer: list[int]) -> Script:
    """Accept, then publish the whole answer in one message of one-token events (a backlog
    that arrives at once)."""

    async def script(worker: ScriptedWorker, task: GenerateTask) -> TaskAck:
        events = [
            worker.event(task, i, [t], finish_reason="length" if i == len(answer) - 1 else None)
            for i, t in enumerate(answer)
        ]
        worker.later(worker.publish(task, *events))
        return TaskAck(accepted=True)

    return script


async def test_an_answer_comes_in_order_and_a_backlog_as_one_event(mesh: Mesh) -> None:
    await mesh.worker("prefill", "p1", together(ANSWER))
    await mesh.worker("decode", "d1", busy())
    decision: dict = {}
    events = await mesh.answer(job(), decision)
    assert len(events) == 1, "eight events already queued are read as one"
    (event,) = events
    assert event.token_ids == ANSWER and event.index == 0 and event.finish_reason == "length"
    assert decision["policy"] == "ttft" and decision["chosen"] == mesh.id("p1")
    assert decision["decode"] == mesh.id("d1")
    (task,) = mesh.workers["p1"].tasks
    assert task.decode_id == mesh.id("d1") and task.decode_kv_address
    assert task.block_hashes and len(task.block_hashes) == 100 // 16
    mesh.settled()


async def test_events_out_of_order_are_released_in_order_duplicates_dropped(mesh: Mesh) -> None:
    async def shuffled(worker: ScriptedWorker, task: GenerateTask) -> TaskAck:
        e = [worker.event(task, i, [t]) for i, t in enumerate(ANSWER)]
        e[-1] = worker.event(task, 7, [ANSWER[7]], finish_reason="stop")

        async def send() -> None:
            for batch in ([e[3], e[4]], [e[0]], [e[0], e[1]], [e[2]], e[5:]):
                await worker.publish(task, *batch)
                await asyncio.sleep(0.005)

        worker.later(send())
        return TaskAck(accepted=True)

    await mesh.worker("prefill", "p1", shuffled)
    await mesh.worker("decode", "d1", busy())
    events = await mesh.answer(job())
    assert mesh.tokens(events) == ANSWER and contiguous(events)
    assert events[-1].finish_reason == "stop"
    mesh.settled()


async def test_a_busy_worker_is_skipped_and_all_busy_is_429(mesh: Mesh) -> None:
    p1 = await mesh.worker("prefill", "p1", busy())
    p2 = await mesh.worker("prefill", "p2", tokens(ANSWER))
    await mesh.worker("decode", "d1", busy())
    assert mesh.tokens(await mesh.answer(job())) == ANSWER
    assert len(p1.tasks) == 1 and len(p2.tasks) == 1  # p1 was asked first, and said busy
    assert mesh.breakers.state(mesh.id("p1")) == "closed"  # busy is no fault
    p2.script = busy()
    with pytest.raises(ApiError) as err:
        await mesh.answer(job())
    assert err.value.status == 429 and err.value.retry_after_s == 1
    assert "all 2 workers are busy" in err.value.message
    mesh.settled()


async def test_a_worker_that_never_acks_is_given_up_for_another(mesh: Mesh) -> None:
    await mesh.worker("prefill", "p1", silent())
    p2 = await mesh.worker("prefill", "p2", tokens(ANSWER))
    await mesh.worker("decode", "d1", busy())
    started = time.monotonic()
    first = job()
    assert mesh.tokens(await mesh.answer(first)) == ANSWER
    assert time.monotonic() - started < 1.0
    (task,) = p2.tasks
    assert task.request_id == f"{first.request_id}-retry1"  # a move has an id of its own
    mesh.settled()


async def test_no_first_token_within_the_bound_moves_the_request(mesh: Mesh) -> None:
    p1 = await mesh.worker("prefill", "p1", tokens(ANSWER, stop_at=0))  # accepts, then nothing
    await mesh.worker("prefill", "p2", tokens(ANSWER))
    await mesh.worker("decode", "d1", busy())
    await mesh.worker("decode", "d2", busy())  # (no first token: both workers are left out)
    first = job()
    assert mesh.tokens(await mesh.answer(first)) == ANSWER
    assert await _cancelled(p1, first), "the worker given up on is told to cancel"
    mesh.settled()


async def _cancelled(worker: ScriptedWorker, job: Job) -> bool:
    for _ in range(50):
        if job.request_id in worker.cancelled:
            return True
        await asyncio.sleep(0.01)
    return False


def freezing(answer: list[int], after: int) -> Script:
    """The first task's answer stops after ``after`` tokens; a resumed one is answered."""

    async def script(worker: ScriptedWorker, task: GenerateTask) -> TaskAck:
        stop_at = after if task.sampling.answer_offset == 0 else -1
        return await tokens(answer, gap_s=0.002, stop_at=stop_at)(worker, task)

    return script


async def test_a_frozen_decode_mid_answer_resumes_elsewhere_with_no_gap(mesh: Mesh) -> None:
    p1 = await mesh.worker("prefill", "p1", freezing(ANSWER, after=3))
    await mesh.worker("decode", "d1", busy())
    await mesh.worker("decode", "d2", busy())
    first = job(max_tokens=8)
    events = await mesh.answer(first)
    assert mesh.tokens(events) == ANSWER, "every token once, in order"
    assert contiguous(events)
    resumed = p1.tasks[1]
    assert resumed.request_id == f"{first.request_id}-resume1"
    assert resumed.token_ids == [*first.prompt_ids, *ANSWER[:3]]
    assert resumed.sampling.max_tokens == 5 and resumed.sampling.answer_offset == 3
    assert {p1.tasks[0].decode_id, resumed.decode_id} == {mesh.id("d1"), mesh.id("d2")}
    mesh.settled()


async def test_a_worker_leaving_the_registry_moves_its_requests(mesh: Mesh) -> None:
    p1 = await mesh.worker("prefill", "p1", tokens(ANSWER, gap_s=0.05))
    await mesh.worker("prefill", "p2", tokens(ANSWER))
    await mesh.worker("decode", "d1", busy())
    answer = mesh.dispatcher.generate(job())
    got = [await anext(answer)]
    mesh.registry.remove(p1.service_id)  # it stopped heartbeating
    got += [e async for e in answer]
    assert mesh.tokens(got) == ANSWER
    assert len(mesh.workers["p2"].tasks) == 1
    mesh.settled()


def waiting(m: Mesh):  # noqa: ANN201
    async def check() -> bool:
        return m.dispatcher.resumes_waiting.count == 1

    return check


async def test_mid_answer_with_no_worker_left_it_waits_for_one_to_come_back(
    bus: Bus, tmp_path: Path
) -> None:
    """The only prefill worker and the only decode worker go away mid-answer (their NATS
    node lost, say): the answer, half sent, waits up to resume_wait_s for a worker, and
    resumes on the first one back (registered again since it was given up on)."""
    m = Mesh(bus, FAST.model_copy(update={"resume_wait_s": 5.0}), [0.0], tmp_path)
    await m.dispatcher.start()
    try:
        p1 = await m.worker("prefill", "p1", freezing(ANSWER, after=3))
        d1 = await m.worker("decode", "d1", busy())
        answer = m.dispatcher.generate(job())
        got = [await anext(answer)]
        for w in (p1, d1):
            m.registry.remove(w.service_id)  # (they stopped heartbeating)
        rest = asyncio.ensure_future(collect(answer))
        await until(waiting(m), 5, "the answer waiting for a worker")
        assert not rest.done(), "it waits for a worker rather than failing"
        for w in (p1, d1):
            m.registry.observe(w.heartbeat(), time.monotonic())  # back
        got += await asyncio.wait_for(rest, 5)
        assert m.tokens(got) == ANSWER and contiguous(got)
        assert p1.tasks[-1].request_id.endswith("-resume1")
        m.settled()
    finally:
        await m.dispatcher.stop()


async def test_mid_answer_a_worker_given_up_on_for_silence_is_tried_again_once_heard(
    bus: Bus, tmp_path: Path
) -> None:
    """The only decode worker goes silent mid-answer (its NATS node lost: tokens and tasks
    gone, no fault of its own) and is given up on, but stays registered. Once it is heard
    from again (a heartbeat), the answer waiting for a worker resumes on it."""
    m = Mesh(bus, FAST.model_copy(update={"resume_wait_s": 5.0}), [0.0], tmp_path)
    await m.dispatcher.start()
    try:
        await m.worker("prefill", "p1", freezing(ANSWER, after=3))
        d1 = await m.worker("decode", "d1", busy())
        rest = asyncio.ensure_future(collect(m.dispatcher.generate(job())))
        # (given up on after 0.3 s; then the answer waits, and must not fail meanwhile)
        await until(waiting(m), 5, "the answer waiting for a worker")
        assert not rest.done(), "it waits rather than failing"
        beat = m.registry.get(d1.service_id).heartbeat  # (the same process, beating again)
        m.registry.observe(beat, time.monotonic())
        got = await asyncio.wait_for(rest, 5)
        assert m.tokens(got) == ANSWER and contiguous(got)
        m.settled()
    finally:
        await m.dispatcher.stop()


async def test_mid_answer_with_no_worker_back_within_the_wait_it_fails(
    bus: Bus, tmp_path: Path
) -> None:
    m = Mesh(bus, FAST.model_copy(update={"resume_wait_s": 0.5}), [0.0], tmp_path)
    await m.dispatcher.start()
    try:
        p1 = await m.worker("prefill", "p1", freezing(ANSWER, after=3))
        await m.worker("decode", "d1", busy())
        answer = m.dispatcher.generate(job())
        await anext(answer)
        m.registry.remove(p1.service_id)
        started = time.monotonic()
        with pytest.raises(ApiError) as err:
            await asyncio.wait_for(collect(answer), 10)
        assert err.value.status == 503 and "no live prefill worker" in err.value.message
        assert time.monotonic() - started >= 0.5  # (it waited for a worker first)
    finally:
        await m.dispatcher.stop()


async def collect(answer: AsyncIterator) -> list:
    return [e async for e in answer]


async def test_leaving_early_cancels_on_the_workers_and_frees_every_count(mesh: Mesh) -> None:
    p1 = await mesh.worker("prefill", "p1", tokens(ANSWER, gap_s=0.05))
    await mesh.worker("decode", "d1", busy())
    first = job()
    answer = mesh.dispatcher.generate(first)
    await anext(answer)
    assert mesh.dispatcher.inflight[p1.service_id] == 1
    await answer.aclose()  # the client went away
    assert await _cancelled(p1, first)
    mesh.settled()


async def test_worker_errors_fail_their_requests_and_open_its_breaker(
    bus: Bus, tmp_path: Path
) -> None:
    async def broken(worker: ScriptedWorker, task: GenerateTask) -> TaskAck:
        error = worker.event(task, 0, [], error="out of memory", error_code="internal")
        worker.later(worker.publish(task, error))
        return TaskAck(accepted=True)

    clock = [0.0]
    mesh = Mesh(bus, FAST, clock, tmp_path)
    await mesh.dispatcher.start()
    await mesh.worker("prefill", "p1", broken)
    await mesh.worker("decode", "d1", busy())
    for _ in range(3):
        with pytest.raises(ApiError) as err:
            await mesh.answer(job())
        assert err.value.status == 500 and "out of memory" in err.value.message
        clock[0] += 1.0  # (apart in time: separate incidents)
    with pytest.raises(ApiError) as err:
        mesh.dispatcher.check_servable("tiny")
    assert err.value.status == 503 and "failing (breakers open)" in err.value.message
    mesh.settled()
    await mesh.dispatcher.stop()


def engine_raises(poison: int) -> Script:
    """A worker whose engine raises on a prompt holding ``poison`` and answers the rest."""
    answer = tokens(ANSWER)

    async def script(worker: ScriptedWorker, task: GenerateTask) -> TaskAck:
        if poison not in task.token_ids:
            return await answer(worker, task)
        why = f"{worker.service_id}: prefill failed: the engine raised"
        error = worker.event(task, 0, [], error=why, error_code="engine")
        worker.later(worker.publish(task, error))
        return TaskAck(accepted=True)

    return script


async def test_a_request_that_breaks_two_engines_fails_and_no_breaker_counts_it(
    bus: Bus, tmp_path: Path
) -> None:
    """A poison request: each engine it reaches raises on it. After the second it fails with
    500 (not moved again), and neither worker's breaker counts it: others' requests go on.
    An engine that raises on a request another worker then answers is a fault of its own."""
    clock = [0.0]
    mesh = Mesh(bus, FAST, clock, tmp_path)
    await mesh.dispatcher.start()
    try:
        p1 = await mesh.worker("prefill", "p1", engine_raises(POISON))
        p2 = await mesh.worker("prefill", "p2", engine_raises(POISON))
        await mesh.worker("decode", "d1", busy())
        poison = replace(job(), prompt_ids=[POISON, *job().prompt_ids])
        for _ in range(4):  # a client sending it again and again
            with pytest.raises(ApiError) as err:
                await mesh.answer(poison)
            assert (err.value.status, err.value.code) == (500, "engine_error")
            assert err.value.message.startswith("the engine failed on this request on 2 workers")
            assert mesh.id("p1") in err.value.message and mesh.id("p2") in err.value.message
            clock[0] += 1.0  # (apart in time: separate incidents, were they counted)
        for w in (p1, p2):
            assert mesh.breakers.state(w.service_id) == "closed"
            assert mesh.breakers.faults(w.service_id) == 0
        assert mesh.tokens(await mesh.answer(job())) == ANSWER  # the others' requests go on
        # p1's engine raising on a request p2 then answers: p1's fault, counted. (p2 says
        # it has a queue, so each goes to p1 first.)
        p1.script = engine_raises(ANSWER[0])
        beat = p2.heartbeat()
        load = beat.load.model_copy(update={"queued_tokens": 5000})
        queued = beat.model_copy(update={"load": load})
        for n in (1, 2):
            mesh.registry.observe(queued, time.monotonic())
            answered = replace(job(), prompt_ids=[ANSWER[0], *job().prompt_ids])
            assert mesh.tokens(await mesh.answer(answered)) == ANSWER
            assert p1.tasks[-1].request_id == answered.request_id  # (it went there first)
            assert mesh.breakers.faults(p1.service_id) == n
            clock[0] += 1.0
        mesh.settled()
    finally:
        await mesh.dispatcher.stop()


async def test_when_no_move_is_left_the_error_says_every_reason(mesh: Mesh) -> None:
    await mesh.worker("prefill", "p1", silent())
    await mesh.worker("prefill", "p2", silent())
    await mesh.worker("decode", "d1", busy())
    with pytest.raises(ApiError) as err:
        await mesh.answer(job())
    message = err.value.message
    assert err.value.status == 503 and "every prefill worker failed this request" in message
    assert mesh.id("p1") in message and mesh.id("p2") in message and "did not answer" in message
    mesh.settled()


async def test_breakers_open_after_faults_in_a_row_and_the_worker_is_skipped(
    bus: Bus, tmp_path: Path
) -> None:
    clock = [0.0]
    mesh = Mesh(bus, FAST, clock, tmp_path)
    await mesh.dispatcher.start()
    p1 = await mesh.worker("prefill", "p1", silent())
    p2 = await mesh.worker("prefill", "p2", tokens(ANSWER))
    await mesh.worker("decode", "d1", busy())
    for _ in range(3):  # three incidents (apart in time), each a silent p1 then p2
        assert mesh.tokens(await mesh.answer(job())) == ANSWER
        clock[0] += 1.0
    assert mesh.breakers.state(p1.service_id) == "open"
    after = job()  # (an earlier incident's task may still be on its way to p1: not counted)
    assert mesh.tokens(await mesh.answer(after)) == ANSWER
    asked = {t.request_id for t in p1.tasks}
    assert after.request_id not in asked, "an open breaker's worker is not asked"
    assert len(p2.tasks) == 4
    p2.script = silent()
    last = job()
    with pytest.raises(ApiError) as err:
        await mesh.answer(last)
    assert (
        err.value.status == 503 and f"prefill {p2.service_id} did not answer" in err.value.message
    )
    assert last.request_id not in {t.request_id for t in p1.tasks}
    mesh.settled()
    await mesh.dispatcher.stop()


async def test_the_deadline_ends_a_request_whose_answer_never_comes(
    bus: Bus, tmp_path: Path
) -> None:
    slow = DispatchSettings(**{**FAST.model_dump(), "first_token_timeout_s": 30.0})
    mesh = Mesh(bus, slow, [0.0], tmp_path)
    await mesh.dispatcher.start()
    await mesh.worker("prefill", "p1", tokens(ANSWER, stop_at=0))
    await mesh.worker("decode", "d1", busy())
    with pytest.raises(ApiError) as err:
        await mesh.answer(job(deadline_s=0.15))
    assert err.value.status == 504 and err.value.code == "timeout"
    mesh.settled()
    await mesh.dispatcher.stop()


async def test_a_short_uncached_prompt_goes_to_decode_which_prefills_it(
    bus: Bus, tmp_path: Path
) -> None:
    local = DispatchSettings(**{**FAST.model_dump(), "local_prefill_max_tokens": 64})
    mesh = Mesh(bus, local, [0.0], tmp_path)
    await mesh.dispatcher.start()
    p1 = await mesh.worker("prefill", "p1", tokens(ANSWER))
    d1 = await mesh.worker("decode", "d1", tokens(ANSWER))
    decision: dict = {}
    assert mesh.tokens(await mesh.answer(job(n_prompt=40), decision)) == ANSWER
    assert not p1.tasks and len(d1.tasks) == 1 and d1.tasks[0].decode_id == d1.service_id
    assert decision["prefill"] == "on decode" and decision["uncached_tokens"] == 40
    mesh.settled()
    await mesh.dispatcher.stop()


async def test_the_cache_plan_sends_a_prompt_where_its_prefix_is(mesh: Mesh) -> None:
    await mesh.worker("prefill", "p1", tokens(ANSWER))
    p2 = await mesh.worker("prefill", "p2", tokens(ANSWER))
    await mesh.worker("decode", "d1", busy())

    prompt = job(n_prompt=600)
    hashes = mesh.dispatcher.plans.hashes(prompt, 16)
    epoch = mesh.registry.get(p2.service_id).heartbeat.started_at
    held = KvEvent(
        kind="stored",
        location=memory_location(p2.service_id),
        hashes=hashes,
        at=time.time(),
        source=p2.service_id,
        epoch=epoch,
        seq=1,
    )
    mesh.kv.index.apply(held, 1)  # (as the KV event stream would bring it)
    decision: dict = {}
    assert mesh.tokens(await mesh.answer(prompt, decision)) == ANSWER
    assert mesh.kv.touched == dict.fromkeys(hashes, 0.0)  # used (no pin): a touch goes next
    assert decision["chosen"] == p2.service_id and len(p2.tasks) == 1
    best = decision["candidates"][0]
    assert best.service_id == p2.service_id and best.terms["memory_tokens"] == 592
    mesh.settled()


async def test_an_expected_answer_length_ranks_decode_workers_by_room_for_that(
    mesh: Mesh,
) -> None:
    """max_tokens 1000 fits only the busier decode worker; an agent expecting 50 tokens
    (x-kvmesh-expected-output-tokens) goes to the idle one with room for those."""
    await mesh.worker("prefill", "p1", tokens(ANSWER))
    small = await mesh.worker("decode", "d1", tokens(ANSWER))
    small.kv_blocks = 10
    mesh.registry.observe(small.heartbeat(), time.monotonic())
    big = await mesh.worker("decode", "d2", tokens(ANSWER))
    big.kv_blocks = 100
    beat = big.heartbeat()
    busy = beat.model_copy(update={"load": beat.load.model_copy(update={"inflight": 3})})
    mesh.registry.observe(busy, time.monotonic())
    plain = job(n_prompt=100, max_tokens=1000)
    assert mesh.tokens(await mesh.answer(plain)) == ANSWER
    hinted = replace(job(n_prompt=100, max_tokens=1000), expected_tokens=50)
    assert mesh.tokens(await mesh.answer(hinted)) == ANSWER
    prefill = mesh.workers["p1"].tasks
    assert [t.decode_id for t in prefill] == [big.service_id, small.service_id]
    mesh.settled()


async def test_flex_and_batch_take_only_the_spare_room(mesh: Mesh) -> None:
    """Refused (429) while the prefill workers have requests waiting, as one of them says;
    the higher classes are not."""
    p1 = await mesh.worker("prefill", "p1", tokens(ANSWER))
    await mesh.worker("prefill", "p2", tokens(ANSWER))
    await mesh.worker("decode", "d1", tokens(ANSWER))
    mesh.dispatcher.check_spare("tiny", "flex")  # nothing waits
    beat = p1.heartbeat()
    waiting = beat.model_copy(update={"load": beat.load.model_copy(update={"queued": 2})})
    mesh.registry.observe(waiting, time.monotonic())
    assert mesh.dispatcher.queues_full("tiny")
    for priority in ("flex", "batch"):
        with pytest.raises(ApiError) as err:
            mesh.dispatcher.check_spare("tiny", priority)
        assert err.value.status == 429 and f"for the {priority} class" in err.value.message
    mesh.dispatcher.check_spare("tiny", "default")
    mesh.dispatcher.check_spare("tiny", "priority")
