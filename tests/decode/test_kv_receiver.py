"""The decode worker's gRPC end of a KV hand-over lets go of each call when it ends, by
reference counts alone: a call left to the garbage collector holds its buffers for minutes
(a soak measured ~500 MB a worker between the collector's passes)."""

from __future__ import annotations

import asyncio
import gc
import time
from types import SimpleNamespace

import grpc

from services.decode.service import KvReceiver
from shared.messages.generate import GenerateTask
from shared.messages.sampling import SamplingParams
from shared.proto import kv_pb2, kv_pb2_grpc
from shared.security.tls import grpc_server

CALLS = 20
AHEAD = 2  # call states the server makes ahead for calls to come (a count that varies)


def live_calls() -> list[object]:
    """gRPC's server-side states of calls alive in this process."""
    return [o for o in gc.get_objects() if type(o).__name__ == "RPCState"]


async def hand_over(stub: kv_pb2_grpc.KvHandoffStub, n: int) -> kv_pb2.HandoffStatus:
    task = GenerateTask(
        request_id=f"r{n}",
        model="tiny",
        token_ids=list(range(64)),
        sampling=SamplingParams(max_tokens=4),
        reply_subject="_INBOX.x",
        decode_id="decode-0",
        decode_kv_address="127.0.0.1:1",
        deadline=0.0,
        handoff_token="forged",
    )
    call = stub.Handoff()  # (as a prefill worker asks: its reserve, then the answer)
    await call.write(kv_pb2.KvChunk(reserve=task.to_bytes()))
    status = await call.read()
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    return status


async def handovers_refused() -> tuple[list[kv_pb2.HandoffStatus], int]:
    """The statuses of CALLS refused hand-overs, and how many call states are alive after
    them that were not before."""
    worker = SimpleNamespace(handoff_secret=b"s" * 32, service_id="decode-0")
    server = grpc_server()
    kv_pb2_grpc.add_KvHandoffServicer_to_server(KvReceiver(worker), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = kv_pb2_grpc.KvHandoffStub(channel)
            await hand_over(stub, -1)  # (the server waits for calls with state made ahead)
            before = {id(o): o for o in live_calls()}  # (held: no id of theirs is reused)

            def new() -> int:
                return sum(id(o) not in before for o in live_calls())

            statuses = [await hand_over(stub, n) for n in range(CALLS)]
            deadline = time.monotonic() + 5.0  # (the server's side ends after the client's)
            while new() > AHEAD and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return statuses, new()
    finally:
        await server.stop(None)


def test_each_hand_over_is_let_go_when_it_ends() -> None:
    gc.collect()
    gc.disable()  # (what the collector would free later does not count)
    try:
        statuses, held = asyncio.run(handovers_refused())
    finally:
        gc.enable()
    assert all(s.code == "unauthorized" and not s.ok for s in statuses), statuses[0]
    assert held <= AHEAD, f"{held} of {CALLS} calls still held"
