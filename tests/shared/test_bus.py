"""The typed NATS helpers against a real nats-server: pub/sub, request/reply, JetStream,
and reconnection when the server restarts."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
from pathlib import Path

import pytest

from kvmesh.natsserver import NatsServer
from shared.bus import Bus, BusError, NoResponders, RemoteError, riding_out
from shared.bus.client import PARTS_HEADER
from shared.messages import Message
from shared.messages.generate import GenerateTask, TaskAck
from shared.messages.sampling import SamplingParams
from shared.worker import Tasks
from tests.procs import free_port, until


class Ping(Message):
    n: int


class Pong(Message):
    n: int
    doubled: int


async def collect(bus: Bus, subject: str) -> asyncio.Queue[Ping]:
    got: asyncio.Queue[Ping] = asyncio.Queue()

    async def on_ping(msg: Ping) -> None:
        await got.put(msg)

    await bus.subscribe(subject, Ping, on_ping)
    await bus.nc.flush()
    return got


async def test_publish_subscribe_typed_and_malformed_dropped(open_nats_url: str) -> None:
    bus = await Bus.connect(open_nats_url, "t-pubsub")
    try:
        got = await collect(bus, "test.pings")
        await bus.nc.publish("test.pings", b'{"n": "not a number"}')  # dropped, not fatal
        await bus.publish("test.pings", Ping(n=7))
        msg = await asyncio.wait_for(got.get(), 2)
        assert msg == Ping(n=7)
        assert got.empty()
    finally:
        await bus.close()


async def test_request_reply_error_and_no_responders(open_nats_url: str) -> None:
    bus = await Bus.connect(open_nats_url, "t-req")
    try:

        async def double(ping: Ping) -> Pong:
            if ping.n < 0:
                raise ValueError("n must be >= 0")
            return Pong(n=ping.n, doubled=2 * ping.n)

        await bus.serve("test.double", Ping, double, queue="doublers")
        assert await bus.request("test.double", Ping(n=21), Pong) == Pong(n=21, doubled=42)
        with pytest.raises(RemoteError, match="n must be >= 0"):
            await bus.request("test.double", Ping(n=-1), Pong)
        with pytest.raises(BusError, match="nobody serves test.nobody"):
            await bus.request("test.nobody", Ping(n=1), Pong, timeout_s=1)
    finally:
        await bus.close()


async def test_an_ask_unanswered_is_sent_again_and_a_task_is_taken_once(
    open_nats_url: str,
) -> None:
    """A worker too slow to ack in time is asked again (as one whose first ask was lost with
    a NATS node): the router gets its ack, and the worker runs the task once."""
    bus = await Bus.connect(open_nats_url, "t-ask")
    taken: list[str] = []
    asks = 0  # the asks on the subject, as a listener beside the worker sees them
    resent = asyncio.Event()

    async def count(_msg) -> None:  # noqa: ANN001
        nonlocal asks
        asks += 1
        if asks == 2:
            resent.set()

    async def on_task(task: GenerateTask) -> TaskAck:
        if task.request_id == "slow":
            await asyncio.wait_for(resent.wait(), 5)  # its first answer comes after the resend
        taken.append(task.request_id)
        return TaskAck(accepted=task.request_id != "refused", reason="busy")

    try:
        await bus.nc.subscribe("test.tasks", cb=count)
        await Tasks(on_task).serve(bus, "test.tasks")
        ask = functools.partial(bus.ask, "test.tasks", reply_type=TaskAck, resend_s=0.1)
        slow = GenerateTask(
            request_id="slow",
            model="m",
            token_ids=[1],
            sampling=SamplingParams(),
            reply_subject="r",
            decode_id="d",
            decode_kv_address="",
            deadline=0,
        )
        ack = await ask(slow, timeout_s=2)
        assert ack.accepted and ack.again
        assert (await ask(slow, timeout_s=2)).again
        refused = slow.model_copy(update={"request_id": "refused"})
        assert not (await ask(refused, timeout_s=2)).accepted
        assert not (await ask(refused, timeout_s=2)).accepted  # refused: asked afresh
        assert taken == ["slow", "refused", "refused"]
        with pytest.raises(NoResponders):  # asked again meanwhile: still nobody
            await bus.ask("test.nobody", slow, TaskAck, timeout_s=0.3)
    finally:
        await bus.close()


async def test_nobody_serving_is_asked_again_only_while_its_check_holds(
    open_nats_url: str,
) -> None:
    """An ask to a subject nobody serves goes on while its check says the server may come
    back (a worker reconnecting), and stops at once when it says not (a worker its router has
    dropped): not after the whole bound."""
    bus = await Bus.connect(open_nats_url, "t-gone")
    checks = 0

    def registered() -> bool:
        nonlocal checks
        checks += 1
        return checks < 3

    try:
        asked = bus.ask("test.gone", Ping(n=1), Pong, timeout_s=60, nobody_again=registered)
        with pytest.raises(NoResponders, match="nobody serves test.gone"):
            await asyncio.wait_for(asked, 10)  # (not the ask's 60 s)
        assert checks == 3
    finally:
        await bus.close()


async def test_a_nats_node_gone_silent_is_left_within_lost_after_s(tmp_path: Path) -> None:
    """A NATS node that stops answering (here frozen: a host cut off sends no reset either)
    is taken as lost within lost_after_s, and the bus is back once a node answers. The
    socket also has the kernel drop it when what was sent goes unacknowledged that long."""
    server = NatsServer("127.0.0.1", free_port(), tmp_path / "js")
    server.start()
    bus = await Bus.connect(server.url, "t-silent", 10, lost_after_s=1.5)
    try:
        writer = bus.nc._transport._bare_io_writer  # (where nats-py keeps its socket)
        sock = writer.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 1500
        os.kill(server.pid, signal.SIGSTOP)
        try:  # (within the bound and a little: pings every 0.5 s, two unanswered)
            await until(async_value(lambda: not bus.connected), 4, "the node taken as lost")
        finally:
            os.kill(server.pid, signal.SIGCONT)
        await until(async_value(lambda: bus.connected), 10, "reconnected")
    finally:
        await bus.close()
        server.stop()


def async_value(check):  # noqa: ANN001, ANN201
    async def value() -> object:
        return check()

    return value


async def test_connect_gives_up_with_a_clear_error() -> None:
    with pytest.raises(BusError, match=r"cannot reach NATS at nats://127.0.0.1:1 within 0.5 s"):
        await Bus.connect("nats://127.0.0.1:1", "t-none", timeout_s=0.5)


async def test_jetstream_durable_consumer_resumes(open_nats_url: str) -> None:
    bus = await Bus.connect(open_nats_url, "t-js")
    try:
        await bus.ensure_stream("TEST_EVENTS", ["test.events.>"])
        await bus.ensure_stream("TEST_EVENTS", ["test.events.>"])  # idempotent
        seqs = [await bus.publish_durable("test.events.a", Ping(n=i)) for i in range(3)]
        assert seqs == sorted(seqs)

        got: asyncio.Queue[tuple[int, int]] = asyncio.Queue()

        async def on_event(msg: Ping, seq: int) -> None:
            await got.put((msg.n, seq))

        sub = await bus.consume_durable("test.events.>", "tester", Ping, on_event)
        assert [await asyncio.wait_for(got.get(), 2) for _ in range(3)] == list(
            zip(range(3), seqs, strict=True)
        )

        async def acked() -> bool:  # the acks landed: nothing is redelivered after leaving
            info = await bus.js.consumer_info("TEST_EVENTS", "tester")
            return info.num_ack_pending == 0 and info.ack_floor.stream_seq == seqs[-1]

        await until(acked, 10, "the acks to land")
        await sub.unsubscribe()
        # Stored while nobody consumed: the durable consumer picks up where it left off.
        later = await bus.publish_durable("test.events.b", Ping(n=3))
        await bus.consume_durable("test.events.>", "tester", Ping, on_event)
        assert await asyncio.wait_for(got.get(), 2) == (3, later)
    finally:
        await bus.close()


async def test_stored_data_larger_than_a_nats_message_goes_in_parts(open_nats_url: str) -> None:
    """Image embeddings of a large model outgrow NATS's max_payload: put_last splits them,
    wait_last joins them, whether the reader comes before or after."""
    bus = await Bus.connect(open_nats_url, "t-parts")
    try:
        await bus.ensure_stream("TEST_PARTS", ["test.parts.>"], memory=True, last_per_subject=True)
        big = os.urandom(2 * bus.nc.max_payload + 12345)  # three parts
        await bus.put_last("test.parts.a", big, headers={"Shape": "3,5"})
        data, headers = await bus.wait_last("TEST_PARTS", "test.parts.a", 1)
        assert data == big and headers["Shape"] == "3,5" and PARTS_HEADER not in headers
        early = asyncio.create_task(bus.wait_last("TEST_PARTS", "test.parts.b", 5))

        async def waiting() -> bool:  # the reader's consumer is there before the writer
            return (await bus.js.stream_info("TEST_PARTS")).state.consumer_count > 0

        await until(waiting, 10, "the reader to wait")
        await bus.put_last("test.parts.b", big[::-1])
        assert (await early)[0] == big[::-1]
        await bus.put_last("test.parts.c", b"small")  # one message, as before
        assert (await bus.wait_last("TEST_PARTS", "test.parts.c", 1))[0] == b"small"
        await bus.js.purge_stream("TEST_PARTS", subject="test.parts.a.part2")
        with pytest.raises(BusError, match="a part of its 3 is gone"):
            await bus.wait_last("TEST_PARTS", "test.parts.a", 1)
    finally:
        await bus.js.delete_stream("TEST_PARTS")
        await bus.close()


async def test_latest_reads_every_subjects_last_message_as_stored(open_nats_url: str) -> None:
    """Batches are listed by ``latest``: the last message of each matching subject, all of
    them, every time (nats-py's ``keys()`` answered none on a loaded CI machine)."""
    bus = await Bus.connect(open_nats_url, "t-latest")
    try:
        await bus.ensure_stream(
            "TEST_LATEST", ["test.latest.>"], memory=True, last_per_subject=True
        )
        assert await bus.latest("TEST_LATEST", "test.latest.>") == []
        for i in range(1500):  # more than one fetch
            await bus.js.publish(f"test.latest.a.{i}", b"old")
        for i in range(0, 1500, 2):
            await bus.js.publish(f"test.latest.a.{i}", f"new {i}".encode())
        await bus.js.publish("test.latest.b.0", b"other")
        for _ in range(3):
            found = {m.subject: m.data for m in await bus.latest("TEST_LATEST", "test.latest.a.*")}
            assert len(found) == 1500
            assert found["test.latest.a.0"] == b"new 0" and found["test.latest.a.1"] == b"old"
        assert (await bus.js.stream_info("TEST_LATEST")).state.consumer_count == 0
    finally:
        await bus.js.delete_stream("TEST_LATEST")
        await bus.close()


async def test_reconnects_after_nats_restart(open_nats_server: NatsServer) -> None:
    bus = await Bus.connect(open_nats_server.url, "t-reconnect")
    try:
        got = await collect(bus, "test.after")
        open_nats_server.stop()

        async def connected() -> bool:
            return bus.connected

        async def disconnected() -> bool:
            return not bus.connected

        await until(disconnected, 10, "the bus to notice")
        open_nats_server.start()
        await until(connected, 30, "the bus to reconnect")
        await bus.publish("test.after", Ping(n=1))  # the subscription was restored too
        assert await asyncio.wait_for(got.get(), 3) == Ping(n=1)
    finally:
        await bus.close()


async def test_a_store_call_rides_out_jetstream_gone_for_a_moment_and_says_when_it_stays_gone(
    open_nats_server: NatsServer,
) -> None:
    """A key-value put while the server is down (as while a replicated stream elects its
    leader) is asked again until it lands; past its wait, a BusError names what it asked."""
    bus = await Bus.connect(open_nats_server.url, "t-ride")
    try:
        kv = await bus.js.create_key_value(bucket="ride")
        open_nats_server.stop()
        put = asyncio.create_task(riding_out(lambda: kv.put("k", b"v"), "key k", 30))
        await asyncio.sleep(1.0)
        assert not put.done()  # still asking
        open_nats_server.start()
        await asyncio.wait_for(put, 30)
        assert (await kv.get("k")).value == b"v"

        open_nats_server.stop()
        with pytest.raises(BusError, match="key k: JetStream unavailable for 1 s"):
            await riding_out(lambda: bus.js.publish("$KV.ride.k", b"w", timeout=0.2), "key k", 1)
    finally:
        open_nats_server.start()
        await bus.close()
