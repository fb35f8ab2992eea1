"""Chaos: faults injected one at a time into a live mesh under load, and what clients saw.

The mesh: a 3-node NATS cluster (streams on all three), cachemeta, 2 routers, 2 prefill and
2 decode workers (tiny model) and an encoder, each a real process on 127.0.0.1. First the
reference answer of every prompt (greedy; text and image prompts) is taken on the calm mesh.
Then CLIENTS streaming clients ask those prompts in turn through both routers (a client whose
router refuses the connection goes to the other, as the README says a client should) while
these faults come one after another, each followed by a restart and a calm spell:

  kill -9 a prefill worker, kill -9 the decode worker with the most streams (mid-stream),
  SIGSTOP a decode worker for 10 s, kill -9 cachemeta, kill -9 the encoder, kill -9 a NATS
  node, kill -9 a router.

Per fault, of the requests that overlapped it: how many, identical to the reference, wrong
(completed but different), failed with an error, hung (no answer within the bound); p99
latency before the faults and during this one; recovery (from the fault to the first answer
to a probe of the kind it touched, asked every 0.25 s from the fault on: an image request for
the encoder, a text one otherwise). Resumed
requests' reuse comes from the routers' traces: of a resumed request's prompt (the original
plus the tokens already sent), the tokens loaded rather than computed again, over all of it
(resume_reuse_ratio) and over its full blocks (resume_block_ratio: the trailing partial block
is never stored, so this is what the tiers could have given). Every prompt starts with the
same few-hundred-token system prompt, as chat and agent requests do.

Prints a table; the last line is one JSON object: requests, identical, wrong, errors, hung,
router_cut (open streams of the killed router, counted apart), image_503_without_encoder
(image requests refused while the one encoder was dead: the documented behaviour, counted
apart), lost_kv_events, resume_reuse_ratio, recovery_s (per fault).

    .venv/bin/python bench/chaos.py [--clients 4] [--calm 8] [--answer 200]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import say  # noqa: E402
from kvmesh.natsconf import write_server_config  # noqa: E402
from kvmesh.natsserver import Cluster, NatsServer, die_with_parent, port_in_use  # noqa: E402
from kvmesh.trace import read_spans  # noqa: E402

HUNG_S = 60.0  # an answer not complete within this is hung
BLOCK = 64  # the workers' KV block size (tokens)
SERVICES = (
    "cachemeta-0",
    "router-0",
    "router-1",
    "prefill-0",
    "prefill-1",
    "decode-0",
    "decode-1",
    "encoder-0",
)


def free_ports(n: int, gap: int = 2000, start: int = 21000) -> int:
    """The first of ``n`` consecutive free ports whose route ports (+ ``gap``) are free too."""
    for first in range(start, 40000, 7):
        ports = [first + i for i in range(n)] + [first + gap + i for i in range(n)]
        if not any(port_in_use("127.0.0.1", p) for p in ports):
            return first
    raise SystemExit("no free ports")


def png(seed: int) -> str:
    img = Image.effect_noise((224, 160), 50 + seed).convert("RGB")
    out = io.BytesIO()
    img.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@dataclass(frozen=True)
class Prompt:
    name: str
    messages: list

    @property
    def image(self) -> bool:
        return self.name.startswith("image")


# What chat and agent requests start with: a system prompt of several hundred tokens, the
# same for every request (as an application's is).
SYSTEM = {
    "role": "system",
    "content": (
        "You are the storyteller of a travel magazine. Write in plain, concrete sentences; "
        "name places, weather, sounds and the people met; never invent statistics; keep a "
        "warm tone without flattery; end with one line the reader can remember. "
    )
    * 12,
}


def prompts() -> list[Prompt]:
    topics = ["a lighthouse", "a harbour", "a mountain pass", "an old library", "a night train"]
    text = [
        Prompt(
            f"text-{i}",
            [SYSTEM, {"role": "user", "content": f"Tell a long story about {t}. " * 4}],
        )
        for i, t in enumerate(topics)
    ]
    images = [
        Prompt(
            f"image-{i}",
            [
                SYSTEM,
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Describe this picture in detail."},
                        {"type": "image_url", "image_url": {"url": png(i)}},
                    ],
                },
            ],
        )
        for i in range(2)
    ]
    return text + images


class Mesh:
    """The processes, each restartable by id; NATS nodes as ``nats-<i>``."""

    def __init__(self, dir: Path) -> None:
        self.dir = dir
        self.nats_port = free_ports(3)
        self.http_port = free_ports(2, gap=1, start=self.nats_port + 10)
        routes = tuple(self.nats_port + 2000 + i for i in range(3))
        config = write_server_config(dir / "nats-server.conf", dir / "secrets")
        self.nats = [
            NatsServer(
                "127.0.0.1",
                self.nats_port + i,
                dir / f"nats-{i}",
                log_file=dir / f"nats-{i}.log",
                config=config,
                cluster=Cluster("chaos", i, routes),
            )
            for i in range(3)
        ]
        self.nats_url = ",".join(f"nats://127.0.0.1:{self.nats_port + i}" for i in range(3))
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls = [f"http://127.0.0.1:{self.http_port + i}" for i in (0, 1)]

    def env(self, sid: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
        env.update(
            KVMESH_NATS_URL=self.nats_url,
            KVMESH_JETSTREAM_REPLICAS="3",
            KVMESH_STATE_DIR=str(self.dir / "state"),
            KVMESH_SECRETS_DIR=str(self.dir / "secrets"),
            KVMESH_SERVICE_ID=sid,
            KVMESH_LOG_LEVEL="info",
            KVMESH_ROUTER_GRPC_PORT="0",
            KVMESH_ROUTER_MISSED_HEARTBEATS="3",
            KVMESH_ROUTER_TOKEN_TIMEOUT_S="3",
            KVMESH_ROUTER_ENCODE_TIMEOUT_S="10",
            KVMESH_PREFILL_MODEL="tiny",
            KVMESH_DECODE_MODEL="tiny",
            KVMESH_PREFILL_THREADS="1",
            KVMESH_DECODE_THREADS="1",
            KVMESH_PREFILL_KV_CACHE_TOKENS="16384",
            KVMESH_DECODE_KV_CACHE_TOKENS="16384",
            KVMESH_ENCODER_MODELS='["tiny"]',
            KVMESH_ENCODER_THREADS="1",
            KVMESH_ENCODER_LAYERS="1",
        )
        if sid.startswith("router-"):
            env["KVMESH_ROUTER_HTTP_PORT"] = str(self.http_port + int(sid[-1]))
        return env

    def start(self, sid: str) -> None:
        if sid.startswith("nats-"):
            self.nats[int(sid[-1])].start()
            return
        role = sid.split("-")[0]
        log = open(self.dir / f"{sid}.log", "ab")  # noqa: SIM115
        self.procs[sid] = subprocess.Popen(
            [sys.executable, "-m", f"services.{role}"],
            env=self.env(sid),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,  # none outlives the benchmark
        )

    def pid(self, sid: str) -> int:
        if sid.startswith("nats-"):
            pid = self.nats[int(sid[-1])].pid
            assert pid is not None
            return pid
        return self.procs[sid].pid

    def signal(self, sid: str, sig: int) -> None:
        os.kill(self.pid(sid), sig)
        if sig == signal.SIGKILL:
            if sid.startswith("nats-"):
                self.nats[int(sid[-1])].proc.wait()
            else:
                self.procs[sid].wait()

    def health(self, url: str) -> dict:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:
            return json.loads(err.read())
        except OSError:
            return {}

    def ready(self, sids: tuple[str, ...] = SERVICES) -> bool:
        """Every service in ``sids`` ready in the registry of every live router."""
        for url in self.urls:
            roles = self.health(url).get("roles", {})
            seen = {e["id"] for es in roles.values() for e in es if e["status"] == "ready"}
            if not set(sids) <= seen:
                return False
        return True

    def wait_ready(self, sids: tuple[str, ...] = SERVICES, timeout_s: float = 120) -> float:
        started = time.monotonic()
        while not self.ready(sids):
            if time.monotonic() - started > timeout_s:
                raise SystemExit(f"not ready within {timeout_s:g} s: see {self.dir}")
            time.sleep(0.1)
        return time.monotonic() - started

    def up(self) -> None:
        for node in self.nats:
            node.start()
        for sid in SERVICES:
            self.start(sid)
        self.wait_ready()

    def down(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for node in self.nats:
            node.stop()


@dataclass
class Result:
    prompt: str
    router: int
    started: float
    ended: float = 0.0
    text: str = ""
    error: str = ""
    cut: bool = False  # its router was killed under it


@dataclass
class Load:
    """CLIENTS threads asking the prompts in turn until stopped."""

    mesh: Mesh
    prompts: list[Prompt]
    answer: int
    results: list[Result] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    dead_routers: set[int] = field(default_factory=set)

    def ask(self, prompt: Prompt, router: int) -> Result:
        result = Result(prompt.name, router, time.monotonic())
        client = openai.OpenAI(
            base_url=f"{self.mesh.urls[router]}/v1", api_key="-", max_retries=0, timeout=HUNG_S
        )
        got_any = False
        try:
            chunks = client.chat.completions.create(
                model="tiny",
                messages=prompt.messages,
                max_tokens=self.answer,
                temperature=0,
                stream=True,
            )
            parts = []
            for chunk in chunks:
                got_any = True
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
            result.text = "".join(parts)
        except openai.APIConnectionError as err:
            result.error = f"connection: {err}"
            result.cut = got_any or router in self.dead_routers
        except openai.APIError as err:
            result.error = str(err)
        result.ended = time.monotonic()
        return result

    def client(self, c: int) -> None:
        i = c
        while not self.stop.is_set():
            prompt = self.prompts[i % len(self.prompts)]
            router = (i + c) % 2
            if router in self.dead_routers:
                router = 1 - router
            result = self.ask(prompt, router)
            if result.error.startswith("connection") and not result.cut:
                result = self.ask(prompt, 1 - router)  # refused: the other router
            self.results.append(result)
            i += 1


def p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@dataclass(frozen=True)
class Fault:
    name: str
    target: str  # a service id, or "decode-busiest"
    sig: int
    hold_s: float  # before the restart (SIGSTOP: before SIGCONT)
    touches_images: bool = False


FAULTS = (
    Fault("kill -9 prefill", "prefill-0", signal.SIGKILL, 2.0),
    Fault("kill -9 decode mid-stream", "decode-busiest", signal.SIGKILL, 2.0),
    Fault("SIGSTOP decode 10 s", "decode-1", signal.SIGSTOP, 10.0),
    Fault("kill -9 cachemeta", "cachemeta-0", signal.SIGKILL, 2.0),
    Fault("kill -9 encoder", "encoder-0", signal.SIGKILL, 2.0, touches_images=True),
    Fault("kill -9 NATS node", "nats-1", signal.SIGKILL, 2.0),
    Fault("kill -9 router", "router-0", signal.SIGKILL, 2.0),
)


def busiest_decode(mesh: Mesh) -> str:
    loads = {}
    for entry in mesh.health(mesh.urls[1]).get("roles", {}).get("decode", []):
        loads[entry["id"]] = entry["load"]["inflight"]
    return max(sorted(loads), key=lambda sid: loads[sid]) if loads else "decode-0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--calm", type=float, default=8.0, help="seconds of calm between faults")
    ap.add_argument("--answer", type=int, default=200, help="tokens per answer")
    args = ap.parse_args()
    dir = Path(tempfile.mkdtemp(prefix="kvmesh-chaos-"))
    mesh = Mesh(dir)
    say(f"starting the mesh in {dir} (3 NATS nodes, {len(SERVICES)} services)")
    mesh.up()
    try:
        run(mesh, args)
    finally:
        mesh.down()


def run(mesh: Mesh, args: argparse.Namespace) -> None:
    ps = prompts()
    load = Load(mesh, ps, args.answer)
    say("reference answers (calm mesh)")
    reference = {}
    for p in ps:
        r = load.ask(p, 0)
        if r.error:
            raise SystemExit(f"reference of {p.name} failed: {r.error}")
        reference[p.name] = r.text
    say(f"load: {args.clients} streaming clients, {args.answer}-token answers")
    threads = [threading.Thread(target=load.client, args=(c,)) for c in range(args.clients)]
    for t in threads:
        t.start()
    windows: list[tuple[Fault, float, float]] = []  # fault, from its injection to its calm's end
    recoveries: dict[str, float | None] = {}
    try:
        time.sleep(args.calm)
        baseline_end = time.monotonic()
        for fault in FAULTS:
            target = busiest_decode(mesh) if fault.target == "decode-busiest" else fault.target
            say(f"fault: {fault.name} ({target})")
            at = time.monotonic()
            if target.startswith("router-"):
                load.dead_routers.add(int(target[-1]))
            mesh.signal(target, fault.sig)
            probe = Probe(load, ps[-1] if fault.touches_images else ps[0], at)
            probe.start()
            time.sleep(fault.hold_s)
            if fault.sig == signal.SIGSTOP:
                mesh.signal(target, signal.SIGCONT)
            else:
                mesh.start(target)
            if not target.startswith("nats-"):
                mesh.wait_ready((target,), 120)
            load.dead_routers.discard(int(target[-1]) if target.startswith("router-") else -1)
            time.sleep(args.calm)
            end = time.monotonic()
            windows.append((fault, at, end))
            recoveries[fault.name] = probe.finish()
    finally:
        load.stop.set()
        for t in threads:
            t.join(HUNG_S + 10)
    with open(mesh.dir / "results.jsonl", "w") as f:  # every request, for a closer look
        for r in load.results:
            f.write(json.dumps(r.__dict__) + "\n")
        for fault, at, end in windows:
            f.write(json.dumps({"fault": fault.name, "at": at, "end": end}) + "\n")
    report(mesh, load.results, reference, baseline_end, windows, recoveries)


class Probe(threading.Thread):
    """After a fault: the request it touched (an image one for the encoder, a text one
    otherwise), short, asked every 0.25 s through a live router until one is answered; the
    recovery is the time from the fault to that answer."""

    def __init__(self, load: Load, prompt: Prompt, at: float) -> None:
        super().__init__(daemon=True)
        self.load, self.prompt, self.at = load, prompt, at
        self.answered: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        k = 0
        while not self.done.is_set():
            router = k % 2
            if router in self.load.dead_routers:
                router = 1 - router
            client = openai.OpenAI(
                base_url=f"{self.load.mesh.urls[router]}/v1",
                api_key="-",
                max_retries=0,
                timeout=HUNG_S,
            )
            try:
                client.chat.completions.create(
                    model="tiny", messages=self.prompt.messages, max_tokens=2, temperature=0
                )
                self.answered = time.monotonic() - self.at
                return
            except openai.APIError:
                k += 1
                time.sleep(0.25)

    def finish(self) -> float | None:
        self.done.set()
        self.join(HUNG_S + 5)
        return round(self.answered, 2) if self.answered is not None else None


def report(
    mesh: Mesh,
    results: list[Result],
    reference: dict[str, str],
    baseline_end: float,
    windows: list,
    recoveries: dict[str, float | None],
) -> None:
    no_encoder = [(at, end) for f, at, end in windows if f.touches_images]

    def window_of(r: Result) -> int | None:
        """The last fault whose window the request overlapped (each is counted once)."""
        hit = [k for k, (_, at, end) in enumerate(windows) if r.started < end and r.ended > at]
        return hit[-1] if hit else None

    def verdict(r: Result) -> str:
        if r.ended - r.started >= HUNG_S:
            return "hung"
        if r.cut:
            return "cut"
        if r.error:
            # With its one encoder dead, an image request gets 503 (images only): expected.
            expected = "encoder" in r.error and any(
                r.started < end and r.ended > at for at, end in no_encoder
            )
            return "expected" if expected else "error"
        return "identical" if r.text == reference[r.prompt] else "wrong"

    before = [r.ended - r.started for r in results if r.ended <= baseline_end and not r.error]
    head = (
        "fault",
        "reqs",
        "identical",
        "wrong",
        "errors",
        "hung",
        "cut",
        "503 img",
        "p99 before",
        "p99 during",
        "recovery",
    )
    print("{:<28}{:>6}{:>10}{:>7}{:>8}{:>6}{:>5}{:>9}{:>12}{:>12}{:>10}".format(*head))
    totals = {"identical": 0, "wrong": 0, "error": 0, "hung": 0, "cut": 0, "expected": 0}
    errors_seen = []
    for k, (fault, *_) in enumerate(windows):
        during = [r for r in results if window_of(r) == k]
        rec = recoveries[fault.name]
        counts = {k: 0 for k in totals}
        for r in during:
            counts[verdict(r)] += 1
            if verdict(r) == "error":
                errors_seen.append(f"{fault.name}: {r.prompt}: {r.error[:160]}")
        lat = [r.ended - r.started for r in during if not r.error]
        print(
            f"{fault.name:<28}{len(during):>6}{counts['identical']:>10}{counts['wrong']:>7}"
            f"{counts['error']:>8}{counts['hung']:>6}{counts['cut']:>5}{counts['expected']:>9}"
            f"{p99(before):>10.2f} s{p99(lat):>10.2f} s"
            f"{(f'{rec:.2f} s' if rec is not None else '-'):>10}"
        )
    for r in results:
        totals[verdict(r)] += 1
    for line in errors_seen[:20]:
        say(f"  error: {line}")
    reused = prompt = whole = resumed = 0
    for span in read_spans(mesh.dir / "state" / "traces"):
        a = span["attributes"]
        if span["name"] == "generate" and a.get("resumed_tokens"):
            resumed += 1
            reused += a.get("reused_tokens", 0)
            prompt += a.get("prompt_tokens", 0)
            whole += a.get("prompt_tokens", 0) // BLOCK * BLOCK  # a partial block is never stored
    lost = sum(
        (mesh.dir / f"{sid}.log").read_text(errors="replace").count("KV event not published")
        for sid in SERVICES
        if (mesh.dir / f"{sid}.log").exists()
    )
    ratio = round(reused / prompt, 3) if prompt else None
    block_ratio = round(reused / whole, 3) if whole else None
    print(
        f"{len(results)} requests; {resumed} resumed mid-answer, prompt tokens loaded {reused} "
        f"of {prompt} ({ratio}; of the {whole} in full blocks: {block_ratio}); "
        f"KV events lost {lost}"
    )
    print(
        json.dumps(
            {
                "requests": len(results),
                "identical": totals["identical"],
                "wrong": totals["wrong"],
                "errors": totals["error"],
                "hung": totals["hung"],
                "router_cut": totals["cut"],
                "image_503_without_encoder": totals["expected"],
                "lost_kv_events": lost,
                "resumed": resumed,
                "resume_reuse_ratio": ratio,
                "resume_block_ratio": block_ratio,
                "recovery_s": recoveries,
                "p99_before_s": round(p99(before), 3),
                "latency_p50_s": round(
                    statistics.median([r.ended - r.started for r in results if not r.error] or [0]),
                    3,
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
