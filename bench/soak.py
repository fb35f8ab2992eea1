"""A soak that shows the plateau: a tiny stack on 127.0.0.1 under a bounded load until its
caches are full, then at least three times as long again, with one fault of each kind on the way.

The stack: router, cachemeta, two prefill and two decode workers (fault hooks on), each
worker's memory tier small and the storage tier capped (cachemeta evicts past it; on a tmpfs
of its own when run as root, so it can be made read-only). The load: ``--clients`` threads,
``--rate`` requests a second between them, each a conversation that grows turn by turn and
starts over (chat, streamed chat and completions; greedy and sampled), so the caches keep
taking new blocks and evicting old ones.

"Full" is when the storage tier reached its eviction watermark, every prefill worker's memory
tier is nine-tenths used, and so are the router's tokenizer cache, the conversations whose
hashes it keeps, the conversations it keeps to explain cache misses, every serving process's
recent traces and the KV event stream on NATS (300,000 tokens, 200 conversations, 2 MiB, 600
traces and 1 MiB here: the defaults, 4 million, 4,096, 64 MiB, 4,096 and 2 GiB, take hours or
days to fill at this load). Every ``--sample-s``: each
process's resident memory and open file descriptors (its children's too; decode's engine
process apart), the KV blocks the workers hold, the requests queued, and each process's NATS
backlog and C heap in use (its /metrics: what is allocated, apart from what the heap only
holds). Growth per hour is the slope of a least-squares line through the samples after the
plateau (of a process's current run: one restarted is measured from a minute after), ± twice
its standard error.

Faults, one of each kind: a decode worker killed (-9) and started again, and cachemeta
killed and started again, while the caches fill; after the plateau, spread over the rest:
a decode worker's steps raising and a prefill worker's prompts raising (each until the
engine has raised, then switched off: its requests move), a prefill worker's KV events lost
for five seconds, and (root) the storage tier read-only for ten. Faults run on a thread of
their own; the samples go on. Workers tolerate 1,000 engine failures in a row here, so a
passing fault does not take them out of service (the default, 3, does: bench/faults.py).

After the load stops: KV blocks still held by any worker once nothing is in flight (leaked).

    .venv/bin/python bench/soak.py [--minutes 30] [--rate 3] [--clients 4]

Prints a progress line per sample, then tables (processes; faults), and as its last line one
JSON object: minutes, full_after_s, requests, errors, leaked_blocks, per process its RSS and
fds at start, plateau and end with growth per hour, the faults, and the largest NATS backlog
and queue seen.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import emit, say  # noqa: E402
from tests.mounts import remount  # noqa: E402
from tests.procs import get_json, metrics, wait_until  # noqa: E402
from tests.stack import Stack, start_stack  # noqa: E402

IDS = ("router-0", "cachemeta-0", "prefill-0", "prefill-1", "decode-0", "decode-1")
STORE_MIB = 48  # the storage tier's capacity (the tmpfs is twice that)
MEMORY_TIER_MIB = 6  # each worker's
TOKEN_CACHE = 300_000  # the router's tokenizer cache, in tokens (~50 bytes each)
RECENT_TRACES = 600  # each process's traces kept for the operator page
PREFIX_PROMPTS = 200  # conversations whose block hashes the router keeps
EVENTS_MIB = 1  # the KV event stream's bound on NATS (the default, 2 GiB, takes days here)
EXPLAIN_MIB = 2  # the router's recent conversations for cache-miss explanations (64 MiB: hours)
EVENTS = "KVMESH_KV_EVENTS"
SETTINGS = {
    "KVMESH_FAULT_HOOKS": "true",
    "KVMESH_CACHEMETA_STORE_CAPACITY_BYTES": str(STORE_MIB << 20),
    "KVMESH_CACHEMETA_GC_INTERVAL_S": "2",
    "KVMESH_CACHEMETA_SNAPSHOT_INTERVAL_S": "10",
    "KVMESH_PREFILL_MEMORY_TIER_BYTES": str(MEMORY_TIER_MIB << 20),
    "KVMESH_DECODE_MEMORY_TIER_BYTES": str(MEMORY_TIER_MIB << 20),
    "KVMESH_PREFILL_MAX_ENGINE_FAILURES": "1000",
    "KVMESH_DECODE_MAX_ENGINE_FAILURES": "1000",
    "KVMESH_PREFILL_STORE_RETRY_S": "5",
    "KVMESH_DECODE_STORE_RETRY_S": "5",
    "KVMESH_ROUTER_TOKEN_CACHE_TOKENS": str(TOKEN_CACHE),
    "KVMESH_RECENT_TRACES": str(RECENT_TRACES),
    "KVMESH_ROUTER_PREFIX_PROMPTS": str(PREFIX_PROMPTS),
    "KVMESH_CACHEMETA_EVENTS_STREAM_BYTES": str(EVENTS_MIB << 20),
    "KVMESH_ROUTER_CACHE_EXPLAIN_BYTES": str(EXPLAIN_MIB << 20),
}
WORKERS = ("prefill", "decode")
WATERMARK = 0.9  # cachemeta's default high watermark
SYLLABLES = "ka lo mi ne su ta ri po ve da lu xe fo gi ha jo".split()  # noqa: SIM905


# -- the load ---------------------------------------------------------------------------------


@dataclass
class Tally:
    requests: int = 0
    errors: Counter = field(default_factory=Counter)
    first_errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def done(self, error: str = "") -> None:
        with self.lock:
            self.requests += 1
            if error:
                self.errors[error.split(":")[0][:60]] += 1
                if len(self.first_errors) < 10:
                    self.first_errors.append(f"{time.strftime('%H:%M:%S')} {error[:300]}")


def words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n)
    )


def client_loop(stack: Stack, n: int, rate: float, stop: threading.Event, tally: Tally) -> None:
    """One client: conversations of 2-6 turns, each turn new text plus the answer so far,
    sent at ``rate`` a second (later when the answers take longer)."""
    rng = random.Random(20261203 + n)
    client = stack.client(timeout=120)
    system = f"You are assistant {n % 2}. " + words(random.Random(n % 2), 60)
    next_at = time.monotonic()
    while not stop.is_set():
        messages = [{"role": "system", "content": system}]
        for _ in range(rng.randint(2, 6)):
            if stop.is_set():
                return
            next_at = max(next_at + 1 / rate, time.monotonic() - 1)
            stop.wait(max(0.0, next_at - time.monotonic()))
            messages.append({"role": "user", "content": words(rng, rng.randint(40, 120))})
            sampling = {"temperature": 0} if rng.random() < 0.5 else {"temperature": 0.8}
            kind = rng.choice(("chat", "stream", "completion"))
            try:
                answer = ask(client, kind, messages, rng.randint(4, 16), sampling)
            except Exception as err:  # noqa: BLE001 (every failure is counted, by kind)
                tally.done(f"{type(err).__name__}: {err}")
                break
            tally.done()
            messages.append({"role": "assistant", "content": answer})


def ask(client, kind: str, messages: list[dict], max_tokens: int, sampling: dict) -> str:  # noqa: ANN001
    if kind == "completion":
        prompt = "\n".join(m["content"] for m in messages)
        out = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, **sampling
        )
        return out.choices[0].text
    if kind == "stream":
        chunks = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=max_tokens, stream=True, **sampling
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, **sampling
    )
    return out.choices[0].message.content or ""


# -- samples ----------------------------------------------------------------------------------


@dataclass
class Sample:
    t: float
    rss_mb: dict[str, float]
    fds: dict[str, int]
    pids: dict[str, int]
    blocks_used: int
    inflight: int
    queued: int
    store_mb: float
    memory_tiers: float  # the least full prefill worker's memory tier, its share used
    token_cache: float  # the router's tokenizer cache, its share used
    traces: float  # the emptiest trace buffer of the router and the workers, its share used
    prefixes: float  # the router's conversations' hashes, its share used
    events: float  # the KV event stream on NATS, its share of its bound (cachemeta's figure)
    explain: float  # the router's conversations kept to explain cache misses, share used
    nats_pending: dict[str, float]
    heap_mb: dict[str, float]  # each service's C heap in use (its /metrics): allocated, not held
    maps_mb: dict[str, dict[str, float]]  # each process's resident MB by kind of mapping


def process_figures(pid: int) -> dict[str, tuple[float, int]]:
    """RSS (MB) and open fds of a process under "", its engine's own process (decode's,
    shared.hosting.process) under "engine", and any other children under "children"."""
    proc = psutil.Process(pid)
    out: dict[str, list[int]] = {"": [0, 0]}
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            part = ""
            if p is not proc:
                engine = "shared.hosting.process" in " ".join(p.cmdline())
                part = "engine" if engine else "children"
            figures = out.setdefault(part, [0, 0])
            figures[0] += p.memory_info().rss
            figures[1] += p.num_fds()
    return {part: (rss / 2**20, fds) for part, (rss, fds) in out.items()}


ARENA_BYTES = 64 << 20  # a glibc thread arena's heap: reserved 64 MiB at a time, so aligned
STACK_BYTES = 8 << 20  # a thread's stack (the default ulimit)


def mapping_kind(start: int, size: int, path: str) -> str:
    """What a mapping of /proc/PID/smaps holds: glibc's main heap (``heap``: brk), a thread
    arena's heap (``arena``), a thread's or the main ``stack``, a ``file`` (code, mapped
    files), else other anonymous memory (``anon``: large blocks malloc maps apart, gRPC's and
    torch's own, NATS's Go heap)."""
    if path == "[heap]":
        return "heap"
    if path == "[stack]" or (not path and size == STACK_BYTES):
        return "stack"
    if path.startswith("/"):
        return "file"
    if not path and start % ARENA_BYTES == 0 and size <= ARENA_BYTES:
        return "arena"
    return "anon"


def mapping_figures(pid: int) -> dict[str, float]:
    """A process's resident MB by kind of mapping (``mapping_kind``); {} when it is gone."""
    out: dict[str, float] = {}
    kind = "anon"
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head, _, rest = line.partition(" ")
                if "-" in head and not head.endswith(":"):  # a mapping's first line
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    fields = rest.split(None, 4)
                    kind = mapping_kind(lo, hi - lo, fields[4].strip() if len(fields) > 4 else "")
                elif head == "Rss:":
                    out[kind] = out.get(kind, 0.0) + int(rest.split()[0]) / 1024
    except OSError:
        return {}
    return out


def sample_mappings(pids: dict[str, int]) -> dict[str, dict[str, float]]:
    """Each process's resident MB by kind of mapping, named as its RSS is (a decode worker's
    engine process under ``ID/engine``)."""
    out = {}
    for sid, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            out[sid] = mapping_figures(pid)
            for child in proc.children(recursive=True):
                if "shared.hosting.process" in " ".join(child.cmdline()):
                    out[f"{sid}/engine"] = mapping_figures(child.pid)
    return out


def sample(stack: Stack, t: float) -> Sample:
    pids = {sid: proc.pid for sid, proc in stack.procs.items() if proc.alive()}
    if stack._nats is not None and stack._nats.pid:
        pids["nats-server"] = stack._nats.pid
    rss, fds = {}, {}
    for sid, pid in pids.items():
        try:
            for part, (r, f) in process_figures(pid).items():
                name = f"{sid}/{part}" if part else sid
                rss[name], fds[name] = r, f
        except psutil.Error as err:  # (one restarting now)
            say(f"  {sid} (pid {pid}) not sampled: {err!r}")
    listed = stack.health()
    loads = [e["load"] for sid, e in listed.items() if sid.startswith(WORKERS)]
    tiers = [
        e["load"]["memory_tier_bytes"] / max(1, e["load"]["memory_tier_capacity"])
        for sid, e in listed.items()
        if sid.startswith("prefill")
    ]
    store = 0.0
    with contextlib.suppress(OSError, KeyError):
        store = get_json(f"{stack.advertised('cachemeta-0')}/health")[1]["storage_tier"]["bytes"]
    pending, token_cache, traces, prefixes, events, explain, heap = {}, 0.0, [], 0.0, 0.0, 0.0, {}
    for sid in pids:
        if sid == "nats-server" or not (url := stack.advertised(sid)):
            continue
        with contextlib.suppress(OSError):
            m = metrics(url)
            pending[sid] = sum(
                v for (name, _), v in m.items() if name == "kvmesh_nats_pending_bytes"
            )
            if (in_use := m.get(("kvmesh_heap_bytes", (("of", "in_use"),)))) is not None:
                heap[sid] = in_use / 2**20
            if sid.startswith(("router", *WORKERS)):
                kept = m.get(("kvmesh_recent_traces", ()), 0.0)
                traces.append(kept / RECENT_TRACES)
            if sid.startswith("router"):
                cached = [v for (n, _), v in m.items() if n == "kvmesh_router_token_cache_tokens"]
                token_cache = sum(cached) / TOKEN_CACHE
                prefixes = m.get(("kvmesh_router_prefix_prompts", ()), 0.0) / PREFIX_PROMPTS
                explained = m.get(("kvmesh_router_cache_explain_bytes", ()), 0.0)
                explain = explained / (EXPLAIN_MIB << 20)
            if sid.startswith("cachemeta"):
                stream = {
                    of: m.get(("kvmesh_stream_bytes", (("of", of), ("stream", EVENTS))), 0.0)
                    for of in ("held", "limit")
                }
                events = stream["held"] / max(1.0, stream["limit"])
    return Sample(
        t=t,
        rss_mb=rss,
        fds=fds,
        pids=pids,
        blocks_used=sum(load["kv_blocks_used"] for load in loads),
        inflight=sum(load["inflight"] for load in loads),
        queued=sum(load["queued"] for load in loads),
        store_mb=store / 2**20,
        memory_tiers=min(tiers, default=0.0),
        token_cache=token_cache,
        traces=min(traces, default=0.0),
        prefixes=prefixes,
        events=events,
        explain=explain,
        nats_pending=pending,
        heap_mb=heap,
        maps_mb=sample_mappings(pids),
    )


def mapping_slopes(after: list[Sample], name: str) -> dict[str, list[float]]:
    """Each kind of mapping's resident MB/h (± 2 SE) over ``after``, for process ``name``."""
    kinds = dict.fromkeys(k for s in after for k in s.maps_mb.get(name, {}))
    out = {}
    for kind in kinds:
        points = [(s.t, s.maps_mb[name].get(kind, 0.0)) for s in after if s.maps_mb.get(name)]
        slope, err = slope_per_h(points)
        out[kind] = [round(slope, 1), round(err, 1)]
    return out


def slope_per_h(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope (per hour) of (seconds, value) points, and twice its standard error."""
    if len(points) < 3:
        return math.nan, math.nan
    xs, ys = [p[0] / 3600 for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    residuals = [y - (my + slope * (x - mx)) for x, y in zip(xs, ys, strict=True)]
    se = math.sqrt(sum(r * r for r in residuals) / (len(xs) - 2) / sxx)
    return slope, 2 * se


# -- faults -----------------------------------------------------------------------------------


def put_fault(stack: Stack, sid: str, name: str, on: bool) -> None:
    url = f"{stack.advertised(sid)}/faults/{name}"
    urllib.request.urlopen(urllib.request.Request(url, method="PUT" if on else "DELETE"), timeout=5)


@contextlib.contextmanager
def timed(record: dict) -> Iterator[None]:
    started = time.monotonic()
    yield
    record["took_s"] = round(time.monotonic() - started, 2)


def kill_and_start(stack: Stack, sid: str) -> dict:
    record: dict = {"fault": f"{sid} killed (-9), started again"}
    with timed(record):
        os.kill(stack.procs[sid].pid, signal.SIGKILL)
        stack.procs[sid].reap(10)
        stack.start(sid, **stack._own_settings[sid])  # (one traced stays traced)
        stack.wait_ready([sid])
    return record


def engine_raises(stack: Stack, sid: str, hook: str) -> dict:
    """The hook on until the engine has raised (it raises only while it holds work), then
    off: the requests it held move to the other worker."""
    record: dict = {"fault": f"{sid} {hook} raises"}
    url = stack.advertised(sid)

    def failures() -> float:
        return sum(v for (n, _), v in metrics(url).items() if n == "kvmesh_engine_failures_total")

    before = failures()
    put_fault(stack, sid, hook, True)
    try:
        with timed(record):
            wait_until(lambda: failures() > before, 120, 0.05, what=f"{sid}'s engine to raise")
    finally:
        put_fault(stack, sid, hook, False)
    record["engine_failures"] = int(failures() - before)
    record["still_ready"] = sid in stack.ready_ids().get(sid.split("-")[0], [])
    return record


def kv_events_lost(stack: Stack, sid: str, seconds: float) -> dict:
    """Its KV events made and not published: the routers flag its tier stale (routed by
    load) and ask it to resync once it publishes again."""
    record: dict = {"fault": f"{sid} KV events lost for {seconds:g} s"}
    put_fault(stack, sid, "kv_events", True)
    try:
        started = time.monotonic()
        with contextlib.suppress(AssertionError):
            wait_until(lambda: sid in stale(stack), 3 * seconds, 0.1)
            record["flagged_after_s"] = round(time.monotonic() - started, 2)
        time.sleep(max(0.0, seconds - (time.monotonic() - started)))
    finally:
        put_fault(stack, sid, "kv_events", False)
    with timed(record):
        wait_until(lambda: not stale(stack), 60, 0.2, what="the index whole again")
    return record


def stale(stack: Stack) -> dict:
    return get_json(f"{stack.url}/health")[1]["kv_index"]["stale"]


def storage_read_only(stack: Stack, tier: Path, seconds: float) -> dict:
    record: dict = {"fault": f"storage tier read-only for {seconds:g} s"}
    remount(tier, "ro")
    try:
        shown = wait_until(
            lambda: get_json(f"{stack.url}/health")[1]["storage_unwritten"],
            30,
            0.2,
            what="the read-only tier shown",
        )
        record["shown"] = sorted(set(shown.values()))
        time.sleep(seconds)
    finally:
        remount(tier, "rw")
    with timed(record):
        wait_until(
            lambda: not get_json(f"{stack.url}/health")[1]["storage_unwritten"],
            60,
            0.2,
            what="the tier written again",
        )
    return record


# -- the run ----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30, help="at least this long in all")
    parser.add_argument("--rate", type=float, default=3.0, help="requests a second, all clients")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument(
        "--trace-memory",
        nargs="*",
        default=[],
        metavar="ID",
        help="these services traced by tracemalloc (slower): a report at the plateau and at "
        "the end of what grew between, by source line (shared/telemetry/memory.py)",
    )
    parser.add_argument(
        "--arena-max",
        type=int,
        default=0,
        help="MALLOC_ARENA_MAX for every service (glibc's heaps for threads; 0: glibc's own)",
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=0,
        help="MALLOC_MMAP_THRESHOLD_ for every service: allocations this large or more mapped "
        "apart and unmapped when freed (0: glibc's own, which rises to the largest freed)",
    )
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="kvmesh-soak-") as tmp,
        storage_tier(Path(tmp) / "tier") as tier,
    ):
        settings = {**SETTINGS, **({"KVMESH_KV_STORE_DIR": str(tier)} if tier else {})}
        if args.arena_max:
            settings["MALLOC_ARENA_MAX"] = str(args.arena_max)
        if args.mmap_threshold:
            settings["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
        say("starting a tiny stack (two prefill, two decode workers)")
        stack = start_stack("soak", Path(tmp) / "stack", IDS, **settings)
        for sid in args.trace_memory:
            stack.restart(sid, PYTHONTRACEMALLOC="1")
        stack.wait_ready(args.trace_memory)
        try:
            return soak(stack, tier, args)
        finally:
            stack.stop()


@contextlib.contextmanager
def storage_tier(path: Path) -> Iterator[Path | None]:
    """A tmpfs for the storage tier when run as root (it can be made read-only), else None."""
    if os.geteuid() != 0:
        say("not root: the storage tier is a plain directory (no read-only fault)")
        yield None
        return
    path.mkdir(parents=True)
    os.system(f"mount -t tmpfs -o size={2 * STORE_MIB}m tmpfs {path}")  # noqa: S605
    try:
        yield path
    finally:
        os.system(f"umount -l {path}")  # noqa: S605


def soak(stack: Stack, tier: Path | None, args: argparse.Namespace) -> int:
    stop, tally = threading.Event(), Tally()
    rate = args.rate / args.clients
    clients = [
        threading.Thread(target=client_loop, args=(stack, n, rate, stop, tally), daemon=True)
        for n in range(args.clients)
    ]
    started = time.monotonic()
    for c in clients:
        c.start()
    samples: list[Sample] = []
    faults = Faults(started)
    # Killed while the caches fill (a process started again is measured a minute later).
    faults.due(60.0, "decode-1", lambda: kill_and_start(stack, "decode-1"))
    faults.due(120.0, "cachemeta-0", lambda: kill_and_start(stack, "cachemeta-0"))
    late = [
        lambda: engine_raises(stack, "decode-0", "engine_step"),
        lambda: engine_raises(stack, "prefill-0", "engine_prefill"),
        lambda: kv_events_lost(stack, "prefill-1", 5.0),
        *([lambda: storage_read_only(stack, tier, 10.0)] if tier else []),
    ]
    full_at: float | None = None
    end_at = started + args.minutes * 60
    next_sample = started
    while True:
        now = time.monotonic()
        t = now - started
        if now >= next_sample:
            next_sample += args.sample_s
            try:
                s = sample(stack, t)
            except OSError as err:  # a process slow to answer (a traced one's report): next
                say(f"{t:6.0f} s  sample skipped: {err!r}")
                continue
            samples.append(s)
            store_full = s.store_mb >= WATERMARK * STORE_MIB * 0.97
            filled = (s.memory_tiers, s.token_cache, s.traces, s.prefixes, s.events, s.explain)
            full = store_full and min(filled) >= 0.9
            if full_at is None and full:
                full_at = t
                end_at = max(end_at, now + 3 * t)
                span = end_at - now  # the late faults spread over it, none near its end
                for i, fault in enumerate(late):
                    faults.due(t + span * (i + 1) / (len(late) + 2), "", fault)
                say(f"caches full after {t:.0f} s: running until {end_at - started:.0f} s")
                report_memory(stack, args.trace_memory)
            say(
                f"{t:6.0f} s  {tally.requests:6d} requests  {sum(tally.errors.values())} errors"
                f"  store {s.store_mb:5.1f}/{STORE_MIB} MiB  memory tiers {s.memory_tiers:4.0%}"
                f"  token cache {s.token_cache:4.0%}  traces {s.traces:4.0%}"
                f"  prefixes {s.prefixes:4.0%}  events {s.events:4.0%}  explain {s.explain:4.0%}"
                f"  RSS {sum(s.rss_mb.values()):6.0f} MB  fds {sum(s.fds.values()):4d}"
                f"  queued {s.queued}"
            )
        faults.go_on(t)
        if now >= end_at and faults.over():
            break
        time.sleep(0.2)
    stop.set()
    for c in clients:
        c.join(150)
    wait_until(lambda: idle_workers(stack), 60, 0.2, what="the workers idle")
    time.sleep(3)  # a heartbeat interval: the loads listed are the idle ones
    idle = sample(stack, time.monotonic() - started)
    report_memory(stack, args.trace_memory, show=True)
    return report(samples, idle, full_at, faults, tally, args)


def report_written(path: Path, before: int) -> bool:
    """A report appended to ``path`` (past ``before`` bytes) and whole (it ends with a blank
    line)."""
    return path.exists() and path.stat().st_size > before and path.read_text().endswith("\n\n")


def report_memory(stack: Stack, traced: list[str], show: bool = False) -> None:
    """Each traced service writes a memory report; ``show``: the latest printed (what grew
    since the one before)."""
    paths = {sid: stack.dir / "memory" / f"{sid}.txt" for sid in traced}
    sizes = {sid: p.stat().st_size if p.exists() else 0 for sid, p in paths.items()}
    for sid in traced:
        stack.procs[sid].signal(signal.SIGUSR2)
    # A snapshot holds the traced process's loop for seconds: the samples wait for it.
    for sid, path in paths.items():
        wait_until(
            lambda p=path, n=sizes[sid]: report_written(p, n),
            300,
            1.0,
            what=f"{sid}'s memory report",
        )
    if show:
        for sid, path in paths.items():
            print(f"\n{sid}: what grew since the plateau\n" + path.read_text().split("\n# ")[-1])


class Faults:
    """Faults due at given times, run one at a time on a thread of their own (the samples
    go on meanwhile); what each did, and when each restarted process came back."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.queue: list[tuple[float, str, Callable[[], dict]]] = []
        self.done: list[dict] = []
        self.restarted: dict[str, float] = {}
        # One thread for the whole run: a process started from a thread dies when that
        # thread ends (tests/procs.py: die_with_parent's signal is the starting thread's).
        self.thread = ThreadPoolExecutor(max_workers=1)
        self.running: Future | None = None

    def due(self, t: float, restarts: str, run: Callable[[], dict]) -> None:
        self.queue.append((t, restarts, run))
        self.queue.sort(key=lambda item: item[0])

    def go_on(self, t: float) -> None:
        if self.queue and self.queue[0][0] <= t and not self.busy():
            self.running = self.thread.submit(self._run, t, *self.queue.pop(0)[1:])

    def busy(self) -> bool:
        return self.running is not None and not self.running.done()

    def over(self) -> bool:
        return not self.queue and not self.busy()

    def _run(self, t: float, restarts: str, run: Callable[[], dict]) -> None:
        try:
            record = run()
        except Exception as err:  # noqa: BLE001 (a fault that went wrong is reported)
            record = {"fault": getattr(run, "__name__", "fault"), "failed": str(err)[:300]}
        if restarts:
            self.restarted[restarts] = time.monotonic() - self.started
        self.done.append({"at_s": round(t), **record})
        say(f"  fault: {self.done[-1]}")


def idle_workers(stack: Stack) -> bool:
    loads = [e["load"] for sid, e in stack.health().items() if sid.startswith(WORKERS)]
    return all(load["inflight"] == 0 and load["queued"] == 0 for load in loads)


def report(
    samples: list[Sample],
    idle: Sample,
    full_at: float | None,
    faults: Faults,
    tally: Tally,
    args: argparse.Namespace,
) -> int:
    plateau_t = full_at if full_at is not None else samples[len(samples) // 2].t
    names = list(dict.fromkeys(name for s in samples for name in s.rss_mb))
    at_plateau = min(samples, key=lambda s: abs(s.t - plateau_t))
    first = samples[1] if len(samples) > 1 else samples[0]  # (the first is before any load)
    print(
        f"\nsoak: {samples[-1].t / 60:.1f} min, caches full after "
        f"{'never' if full_at is None else f'{full_at:.0f} s'}, {tally.requests} requests, "
        f"{sum(tally.errors.values())} errors"
    )
    print(
        f"{'process':12} {'RSS MB: start':>13} {'plateau':>8} {'end':>7} {'MB/h':>14}"
        f" {'fds: start':>10} {'plateau':>8} {'end':>5} {'fds/h':>12} {'heap in use MB/h':>17}"
    )
    processes = {}
    for name in names:
        since = max(plateau_t, faults.restarted.get(name.split("/")[0], -1.0) + 60)
        after = [s for s in samples if s.t >= since and name in s.rss_mb]
        rss_h, rss_err = slope_per_h([(s.t, s.rss_mb[name]) for s in after])
        fds_h, fds_err = slope_per_h([(s.t, s.fds[name]) for s in after])
        heap_h, heap_err = slope_per_h([(s.t, s.heap_mb[name]) for s in after if name in s.heap_mb])
        row = {
            "rss_mb": [
                round(x.rss_mb.get(name, math.nan), 1) for x in (first, at_plateau, samples[-1])
            ],
            "rss_mb_per_h": [round(rss_h, 1), round(rss_err, 1)],
            "fds": [x.fds.get(name, -1) for x in (first, at_plateau, samples[-1])],
            "fds_per_h": [round(fds_h, 1), round(fds_err, 1)],
            "heap_in_use_mb_per_h": [round(heap_h, 1), round(heap_err, 1)],
            "maps_mb_per_h": mapping_slopes(after, name),
            "measured_from_s": round(since),
        }
        processes[name] = row
        r, f = row["rss_mb"], row["fds"]
        print(
            f"{name:12} {r[0]:>13.1f} {r[1]:>8.1f} {r[2]:>7.1f} "
            f"{rss_h:>+7.1f} ±{rss_err:<5.1f} {f[0]:>10} {f[1]:>8} {f[2]:>5} "
            f"{fds_h:>+6.1f} ±{fds_err:<4.1f} {heap_h:>+9.1f} ±{heap_err:<5.1f}"
        )
    kinds = ("heap", "arena", "anon", "stack", "file")
    print(f"\nresident MB/h after the plateau by kind of mapping (/proc/PID/smaps)\n{'process':12}"
          + "".join(f" {k:>14}" for k in kinds))  # fmt: skip
    for name, row in processes.items():
        by = row["maps_mb_per_h"]
        cells = [f"{by[k][0]:>+7.1f} ±{by[k][1]:<5.1f}" if k in by else f"{'—':>14}" for k in kinds]
        print(f"{name:12} " + " ".join(cells))
    print(f"\n{'at s':>6}  fault")
    for fault in faults.done:
        rest = {k: v for k, v in fault.items() if k not in ("at_s", "fault")}
        print(f"{fault['at_s']:>6}  {fault['fault']}: {rest}")
    if tally.first_errors:
        print("\nfirst errors:\n  " + "\n  ".join(tally.first_errors))
    summary = {
        "minutes": round(samples[-1].t / 60, 1),
        "full_after_s": None if full_at is None else round(full_at),
        "requests": tally.requests,
        "errors": sum(tally.errors.values()),
        "errors_by_kind": dict(tally.errors),
        "leaked_blocks": idle.blocks_used,
        "processes": processes,
        "faults": faults.done,
        "max_nats_pending_bytes": max(max(s.nats_pending.values(), default=0) for s in samples),
        "max_queued": max(s.queued for s in samples),
        "rate": args.rate,
        "clients": args.clients,
    }
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
