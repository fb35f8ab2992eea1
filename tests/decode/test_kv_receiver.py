"""The decode worker's gRPC end of a KV hand-over lets go of each call when it ends, by
reference counts alone: a call left to the garbage collector holds its buffers for minutes
(a soak measured ~500 MB a worker between the collector's passes)."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

import grpc

from services.decode.service import KvReceiver
from shared.messages.generate import GenerateTask
from shared.messages.sampling import SamplingParams
from shared.proto import kv_pb2, kv_pb2_grpc
from shared.security.tls import grpc_server

CALLS = 20
AHEAD = 2  # call states the server makes ahead for calls to come (a count that varies)


def live_calls() -> int:
    """gRPC's server-side state of calls still alive in this process."""
    return sum(type(o).__name__ == "RPCState" for o in gc.get_objects())


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


async def handovers_refused() -> tuple[list[kv_pb2.HandoffStatus], int, int]:
    worker = SimpleNamespace(handoff_secret=b"s" * 32, service_id="decode-0")
    server = grpc_server()
    kv_pb2_grpc.add_KvHandoffServicer_to_server(KvReceiver(worker), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = kv_pb2_grpc.KvHandoffStub(channel)
            await hand_over(stub, -1)  # (the server waits for calls with state made ahead)
            await asyncio.sleep(0.1)
            before = live_calls()
            statuses = [await hand_over(stub, n) for n in range(CALLS)]
            for _ in range(50):  # (the server's side ends a moment after the client's)
                if live_calls() <= before + AHEAD:
                    break
                await asyncio.sleep(0.02)
            return statuses, before, live_calls()
    finally:
        await server.stop(None)


def test_each_hand_over_is_let_go_when_it_ends() -> None:
    gc.collect()
    gc.disable()  # (what the collector would free later does not count)
    try:
        statuses, before, after = asyncio.run(handovers_refused())
    finally:
        gc.enable()
    assert all(s.code == "unauthorized" and not s.ok for s in statuses), statuses[0]
    assert after - before <= AHEAD, f"{after - before} of {CALLS} calls still held"
