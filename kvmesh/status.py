"""`kvmesh status`: the router's registry of live services, as a table."""

from __future__ import annotations

import argparse
import sys

import uvloop

from shared.bus import Bus, BusError, subjects
from shared.bus.auth import connect_options
from shared.messages.heartbeat import RegistryQuery, RegistrySnapshot, WorkerEntry
from shared.settings import CommonSettings, SettingsError, load_settings

COLUMNS = ("ROLE", "ID", "STATUS", "ADDRESS", "HEARTBEAT AGE", "LOAD", "BREAKER", "KV EVENTS")


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("status", help="print the live services as a table")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for NATS")
    p.set_defaults(run=run)


def load_text(e: WorkerEntry) -> str:
    text = f"inflight {e.load.inflight}, queued {e.load.queued}"
    if e.load.kv_blocks_total:
        text += f", kv {e.load.kv_blocks_used}/{e.load.kv_blocks_total}"
    if e.load.kv_store_error:
        text += f", storage tier not written ({e.load.kv_store_error})"
    return text


def format_table(snapshot: RegistrySnapshot) -> str:
    rows = [
        (
            e.role,
            e.service_id,
            e.status,
            e.addresses.get("http", ""),
            f"{e.age_s:.1f} s",
            load_text(e),
            e.breaker.replace("_", "-"),
            e.kv_events,
        )
        for e in snapshot.workers
    ]
    widths = [max(len(str(r[i])) for r in [COLUMNS, *rows]) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [COLUMNS, *rows]
    ]
    mib = snapshot.index_bytes / 2**20
    lines.append(
        f"{len(rows)} services, as seen by router {snapshot.router_id} (its KV index: "
        f"{snapshot.index_blocks} blocks, {mib:.1f} MiB)"
    )
    return "\n".join(lines)


async def fetch(common: CommonSettings, timeout_s: float) -> RegistrySnapshot:
    bus = await Bus.connect(
        common.nats_url, "kvmesh-status", timeout_s, connect_options(common, "cli")
    )
    try:
        return await bus.request(
            subjects.ROUTER_REGISTRY, RegistryQuery(), RegistrySnapshot, timeout_s
        )
    finally:
        await bus.close()


def run(args: argparse.Namespace) -> int:
    try:
        common = load_settings(CommonSettings)
        snapshot = uvloop.run(fetch(common, args.timeout))
    except SettingsError as err:
        print(f"kvmesh status: {err}", file=sys.stderr)
        return 2
    except BusError as err:
        print(f"kvmesh status: {err}; is the stack up (kvmesh up)?", file=sys.stderr)
        return 1
    print(format_table(snapshot))
    return 0
