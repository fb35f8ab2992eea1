"""`kvmesh up`: NATS (one node or a cluster), one cachemeta, N routers and N of each worker
role, as child processes; with ``--model`` (repeatable), N prefill and N decode workers of each
model named (``NAME=PATH`` serves a GGUF file or a Hugging Face directory as NAME).

It waits until a router has registered every child, prints the API URLs, shows each child's
log lines prefixed by its name (and keeps them under the state dir's logs/), and on Ctrl-C or
SIGTERM stops the children, then NATS, leaving no process behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import uvloop

from kvmesh.autoscale import Decider, Hysteresis, bounds
from kvmesh.init import prepare
from kvmesh.natsserver import Cluster, NatsServer, NatsServerError, die_with_parent, is_nats
from services.router.settings import RouterSettings
from shared.bus import Bus, BusError, subjects
from shared.bus.auth import connect_options
from shared.logs import setup_logging
from shared.messages.heartbeat import PlanQuery, PlanReply, RegistryQuery, RegistrySnapshot
from shared.model.catalog import SETTING, ModelError
from shared.model.lora import LoraError, check_adapter, parse_spec
from shared.model.text import check_model, load_config
from shared.offline import offline_env
from shared.security.tls import client_context
from shared.settings import CommonSettings, SettingsError, load_settings

log = logging.getLogger("kvmesh.up")

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("up", help="start a local stack and stream its logs")
    for role in ("prefill", "decode", "encoder"):
        p.add_argument(
            f"--{role}", type=int, metavar="N", help=f"{role} workers (1; 0 with --upstream)"
        )
    p.add_argument(
        "--routers",
        type=int,
        default=1,
        metavar="N",
        help="routers, serving the API on consecutive ports from the router's port",
    )
    p.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="NATS nodes: N > 1 starts a cluster on consecutive ports (routes on the client "
        "port + 2000), streams kept on min(N, 3) nodes",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME[=PATH]",
        help="serve this model (repeatable): --prefill and --decode workers of its own; PATH "
        "(a GGUF file or a Hugging Face directory) serves that checkpoint as NAME. Without "
        "it, the workers serve their KVMESH_PREFILL_MODEL / KVMESH_DECODE_MODEL",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=BASE:PATH",
        help="serve a LoRA adapter as the model NAME (repeatable): a PEFT adapter directory "
        "(adapter_config.json, adapter_model.safetensors) of the model BASE, computed by BASE's "
        "workers (KVMESH_LORAS; more load at run time: POST /v1/load_lora_adapter)",
    )
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="[MODEL=]URL",
        help="route to this server as well (repeatable): an OpenAI-compatible server kvmesh did "
        "not start (vllm serve, SGLang's server) at http://host:port, or dns://name:port for "
        "every address of a name; MODEL is the kvmesh model it serves (the bundled one by "
        "default). With it, no kvmesh workers start unless asked for",
    )
    p.add_argument(
        "--autoscale",
        metavar="MIN:MAX",
        help="prefill and decode workers follow the routers' plan (/v1/plan) between MIN and "
        "MAX each: added when it asks for more, drained then stopped when it asks for fewer",
    )
    p.add_argument(
        "--autoscale-every",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between two looks at the plan (growing takes 2 in a row asking for more, "
        "shrinking 6 asking for fewer; then none for 6 looks)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for every service")
    p.add_argument(
        "--tls",
        action="store_true",
        help="TLS everywhere: a local CA and certificates under the state dir (mutual TLS "
        "between services and with NATS; clients trust <state_dir>/tls/ca.crt)",
    )
    p.set_defaults(run=run)


@dataclass
class Child:
    name: str  # also its service id: role-index
    role: str
    env: dict[str, str] = field(default_factory=dict)  # its own settings
    proc: asyncio.subprocess.Process | None = None
    pump: asyncio.Task | None = field(default=None, repr=False)
    draining: bool = False  # told to stop by the autoscaler (its exit is expected)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


ROUTE_PORT_OFFSET = 2000  # a cluster node's route port: its client port + this (6222 for 4222)


class Stack:
    """The processes of one local stack and the order in which they start and stop."""

    def __init__(
        self,
        common: CommonSettings,
        router: RouterSettings,
        counts: dict[str, int],
        tls: bool = False,
        nats_nodes: int = 1,
        models: list[str] | None = None,
        autoscale: Decider | None = None,
        autoscale_every_s: float = 5.0,
    ) -> None:
        self.common = common
        self.autoscale = autoscale
        self.autoscale_every_s = autoscale_every_s
        self.prepared = prepare(common, tls)
        scheme = "https" if tls else "http"
        self.children = [Child("cachemeta-0", "cachemeta")]
        self.api_urls = []
        for i in range(counts["router"]):
            env = {"KVMESH_ROUTER_HTTP_PORT": str(router.http_port + i)}
            if router.upstreams:
                env["KVMESH_ROUTER_UPSTREAMS"] = json.dumps(router.upstreams)
            if router.grpc_port:
                env["KVMESH_ROUTER_GRPC_PORT"] = str(router.grpc_port + i)
            self.children.append(Child(f"router-{i}", "router", env))
            self.api_urls.append(f"{scheme}://{router.http_host}:{router.http_port + i}")
        self.children += pinned(workers(counts, models or []), os.environ)
        self.nats_nodes = nats_nodes
        self.nats: list[NatsServer] = []
        self.nats_url = common.nats_url
        self.logs_dir = common.state_dir / "logs"

    def start_nats(self) -> None:
        """Use the NATS at nats_url when one answers there, else start one on that port (or
        a cluster on consecutive ports), configured with the mesh's identities (and TLS)."""
        url = self.common.nats_url
        if any(is_nats(u) for u in self.common.nats_servers):
            log.info("using the NATS server at %s", url)
            return
        parts = urlsplit(self.common.nats_servers[0])
        if parts.hostname not in LOCAL_HOSTS:
            raise NatsServerError(f"KVMESH_NATS_URL={url}: no NATS server answers there")
        port = parts.port or 4222
        ports = [port + i for i in range(self.nats_nodes)]
        routes = tuple(p + ROUTE_PORT_OFFSET for p in ports)
        for i, node_port in enumerate(ports):
            one = self.nats_nodes == 1
            self.nats.append(
                NatsServer(
                    "127.0.0.1",
                    node_port,
                    self.common.state_dir / "nats" / ("" if one else f"node-{i}"),
                    log_file=self.logs_dir / ("nats.log" if one else f"nats-{i}.log"),
                    config=self.prepared.nats_config,
                    tls=self.prepared.tls is not None,
                    cluster=None if one else Cluster("kvmesh", i, routes),
                )
            )
        try:
            self.nats_url = ",".join(node.start() for node in self.nats)
        except NatsServerError:
            self.stop_nats()
            raise
        log.info(
            "started %s at %s (JetStream in %s; clients need a role's identity%s)",
            "nats-server" if self.nats_nodes == 1 else f"a {self.nats_nodes}-node NATS cluster",
            self.nats_url,
            self.common.state_dir / "nats",
            ", TLS and a certificate" if self.prepared.tls else "",
        )

    def stop_nats(self) -> None:
        for node in self.nats:
            node.stop()
        if self.nats:
            log.info("stopped nats-server")

    async def spawn(self, child: Child) -> None:
        env = offline_env(os.environ)  # (usage reports and the Hub off: shared/offline.py)
        env.update(KVMESH_NATS_URL=self.nats_url, KVMESH_SERVICE_ID=child.name)
        if self.common.models:  # what --model added, for every service
            env[SETTING] = json.dumps({k: str(v) for k, v in self.common.models.items()})
        if self.common.loras:  # ... and --lora
            env["KVMESH_LORAS"] = json.dumps(self.common.loras)
        env.update(child.env)
        if self.nats_nodes > 1 and "KVMESH_JETSTREAM_REPLICAS" not in env:
            env["KVMESH_JETSTREAM_REPLICAS"] = str(min(3, self.nats_nodes))
        if self.prepared.tls is not None:
            env.update(self.prepared.tls.env(child.role))
        child.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            f"services.{child.role}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C reaches only us; we stop children in order
            preexec_fn=die_with_parent,
        )
        child.pump = asyncio.create_task(self.pump_logs(child))

    def cli_options(self) -> dict:
        """This command's own NATS connection: the cli role's identity (and certificate)."""
        options = connect_options(self.common, "cli")
        if self.prepared.tls is not None:
            cert = self.prepared.tls.certs["cli"]
            options["tls"] = client_context(self.prepared.tls.ca, cert.cert, cert.key)
        return options

    async def pump_logs(self, child: Child) -> None:
        """Echo the child's lines with its name in front, and append them to its log file."""
        assert child.proc is not None and child.proc.stdout is not None
        width = max(len(c.name) for c in self.children)
        with open(self.logs_dir / f"{child.name}.log", "ab") as file:
            async for line in child.proc.stdout:
                file.write(line)
                file.flush()
                sys.stdout.write(f"{child.name:<{width}} | {line.decode(errors='replace')}")
                sys.stdout.flush()

    def exited(self) -> list[Child]:
        return [c for c in self.children if c.proc is not None and c.proc.returncode is not None]

    async def wait_registered(self, bus: Bus, timeout_s: float) -> None:
        """Poll the router's registry until every child is there and ready."""
        expected = {c.name for c in self.children}
        deadline = time.monotonic() + timeout_s
        shown: set[str] | None = None
        while True:
            if dead := self.exited():
                names = ", ".join(f"{c.name} (exit code {c.proc.returncode})" for c in dead)
                raise RuntimeError(f"{names} stopped while the stack was starting; see above")
            try:
                snap = await bus.request(
                    subjects.ROUTER_REGISTRY, RegistryQuery(), RegistrySnapshot, 1.0
                )
                ready = {w.service_id for w in snap.workers if w.status == "ready"}
            except BusError:
                ready = set()
            waiting = expected - ready
            if not waiting:
                return
            if waiting != shown:
                log.info("waiting for %s", ", ".join(sorted(waiting)))
                shown = waiting
            if time.monotonic() > deadline:
                raise RuntimeError(f"not registered within {timeout_s:g} s: {sorted(waiting)}")
            await asyncio.sleep(0.25)

    async def stop(self) -> None:
        """SIGTERM every child (each drains), SIGKILL what is left after the bound, then NATS."""
        running = [c for c in self.children if c.proc and c.proc.returncode is None]
        for child in running:
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
        bound = self.common.drain_timeout_s + 5
        waits = [asyncio.wait_for(c.proc.wait(), bound) for c in running]
        for child, result in zip(
            running, await asyncio.gather(*waits, return_exceptions=True), strict=True
        ):
            if isinstance(result, TimeoutError):
                log.warning("%s did not stop within %g s: killed", child.name, bound)
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
                await child.proc.wait()
        for child in self.children:
            if child.pump is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(child.pump, 2)
        self.stop_nats()

    async def run(self, timeout_s: float) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.start_nats()
        bus = None
        try:
            for child in self.children:
                await self.spawn(child)
            bus = await Bus.connect(self.nats_url, "kvmesh-up", 10, self.cli_options())
            registered = asyncio.ensure_future(self.wait_registered(bus, timeout_s))
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait([registered, stopping], return_when=asyncio.FIRST_COMPLETED)
            if not registered.done():
                registered.cancel()
                return 0
            stopping.cancel()
            registered.result()
            print(
                f"kvmesh is up: {len(self.children)} services, API at "
                f"{', '.join(self.api_urls)} (Ctrl-C stops it)",
                flush=True,
            )
            scaling = None
            if self.autoscale is not None:
                scaling = asyncio.create_task(self.follow_plan(bus, self.autoscale))
            try:
                await self.watch(stop)
            finally:
                if scaling is not None:
                    scaling.cancel()
                    await asyncio.gather(scaling, return_exceptions=True)
            return 0
        except (RuntimeError, BusError) as err:
            log.error("%s", err)
            return 1
        finally:
            if bus is not None:
                await bus.close()
            log.info("stopping %d services", len(self.children))
            await self.stop()

    async def watch(self, stop: asyncio.Event) -> None:
        """Until a signal: report a child that exits (the rest of the mesh keeps serving)."""
        reported: set[str] = set()
        while not stop.is_set():
            for child in self.exited():
                if child.name in reported:
                    continue
                reported.add(child.name)
                if child.draining and child.proc.returncode == 0:
                    log.info("autoscale: %s drained and stopped", child.name)
                else:
                    log.error("%s exited with code %s", child.name, child.proc.returncode)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    # -- autoscaling ---------------------------------------------------------------------------

    async def follow_plan(self, bus: Bus, decider: Decider) -> None:
        """Every few seconds, the routers' plan; each pool moved as the decider says."""
        while True:
            await asyncio.sleep(self.autoscale_every_s)
            try:
                plan = await bus.request(subjects.ROUTER_PLAN, PlanQuery(), PlanReply, 2.0)
            except BusError as err:
                log.warning("autoscale: no plan from a router (%s)", err)
                continue
            for role in AUTOSCALED:
                serving = [
                    c for c in self.children if c.role == role and c.running and not c.draining
                ]
                wanted = plan.recommended.get(role, len(serving))
                size = decider.decide(role, wanted, len(serving), time.monotonic())
                why = f"the plan asks {wanted} for {plan.requests} requests in {plan.window_s:g} s"
                if size > len(serving):
                    added = [self.another(role) for _ in range(size - len(serving))]
                    for child in added:
                        await self.spawn(child)
                    names = ", ".join(c.name for c in added)
                    log.info(
                        "autoscale: %s %d → %d (%s): %s started",
                        role,
                        len(serving),
                        size,
                        why,
                        names,
                    )
                elif size < len(serving):
                    victim = serving[-1]  # (the newest)
                    victim.draining = True
                    with contextlib.suppress(ProcessLookupError):
                        victim.proc.send_signal(signal.SIGTERM)  # it drains, then stops
                    log.info(
                        "autoscale: %s %d → %d (%s): %s draining",
                        role,
                        len(serving),
                        size,
                        why,
                        victim.name,
                    )

    def another(self, role: str) -> Child:
        """A new worker of ``role``, set up as its first one, with the next free index."""
        first = next(c for c in self.children if c.role == role)
        base = first.name.rsplit("-", 1)[0]
        taken = [int(c.name.rsplit("-", 1)[1]) for c in self.children if c.role == role]
        child = Child(f"{base}-{max(taken) + 1}", role, dict(first.env))
        self.children.append(child)
        return child


AUTOSCALED = ("prefill", "decode")


def workers(counts: dict[str, int], models: list[str]) -> list[Child]:
    """The workers: ``counts[role]`` of each role, serving their own settings' model; with
    ``models``, that many prefill and decode workers per model (named after it when there are
    several) and encoders making embeddings for those models only."""
    if not models:
        return [
            Child(f"{role}-{i}", role)
            for role in ("prefill", "decode", "encoder")
            for i in range(counts[role])
        ]
    children = []
    for model in models:
        tag = "" if len(models) == 1 else f"{service_tag(model)}-"
        for role in ("prefill", "decode"):
            env = {f"KVMESH_{role.upper()}_MODEL": model}
            children += [Child(f"{role}-{tag}{i}", role, env) for i in range(counts[role])]
    encoder_env = {"KVMESH_ENCODER_MODELS": json.dumps(models)}
    return children + [
        Child(f"encoder-{i}", "encoder", encoder_env) for i in range(counts["encoder"])
    ]


def pinned(children: list[Child], environ: Mapping[str, str]) -> list[Child]:
    """The workers, each vLLM one with CPU cores of its own (this process's cores split evenly
    among them; one each, round robin, when they outnumber the cores) unless its role's cores
    are set: left to itself, every vLLM engine on a host binds its threads to the same first
    cores, and two engines then share them."""
    cores = sorted(os.sched_getaffinity(0))
    vllm = []
    for child in children:
        role = child.role.upper()
        engine = child.env.get(f"KVMESH_{role}_ENGINE", environ.get(f"KVMESH_{role}_ENGINE", ""))
        setting = f"KVMESH_{role}_CPU_CORES"
        if engine == "vllm" and setting not in environ and setting not in child.env:
            vllm.append((child, setting))
    share = max(1, len(cores) // max(1, len(vllm)))
    for i, (child, setting) in enumerate(vllm):
        first = (i * share) % len(cores)
        child.env[setting] = ",".join(str(c) for c in cores[first : first + share])
    return children


def service_tag(model: str) -> str:
    """A model name as part of a service id (letters, digits, ``_.-``; at most 40)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", model).strip("-")[:40] or "model"


def served_models(options: list[str], common: CommonSettings) -> dict[str, str | None]:
    """``--model`` options as name → path (None: a name the catalog already knows); a
    ValueError naming the option when one is malformed or given twice."""
    models: dict[str, str | None] = {}
    for option in options:
        name, sep, path = option.partition("=")
        name = name.strip()
        if not name or (sep and not path.strip()):
            raise ValueError(f"--model {option!r}: give NAME or NAME=PATH")
        if name in models or (sep and name in common.models):
            raise ValueError(f"--model {name}: given twice (here or in {SETTING})")
        models[name] = str(Path(path.strip()).expanduser().resolve()) if sep else None
    return models


def with_models(common: CommonSettings, options: list[str]) -> tuple[CommonSettings, list[str]]:
    """The settings with ``--model`` paths added to the catalog, and the names to serve,
    each checked as a worker would at start (ValueError naming the option and the file)."""
    models = served_models(options, common)
    paths = {name: path for name, path in models.items() if path is not None}
    common = common.model_copy(update={"models": {**common.models, **paths}})
    seen: set[str] = set()
    for name in models:
        tag = service_tag(name)
        if len(models) > 1 and tag in seen:
            raise ValueError(f"--model {name}: its service ids would repeat another model's")
        seen.add(tag)
        try:
            check_model(name, Path(common.state_dir), common.models)
        except ModelError as err:
            raise ValueError(f"--model {name}: {err}") from None
    return common, list(models)


def with_loras(common: CommonSettings, options: list[str]) -> CommonSettings:
    """The settings with ``--lora`` adapters added, each read and checked against its base
    model (ValueError naming the option, the file and the mismatch)."""
    loras = dict(common.loras)
    for option in options:
        try:
            spec = parse_spec(option)
        except LoraError as err:
            raise ValueError(f"--lora {option!r}: {err}") from None
        if spec.name in loras:
            raise ValueError(f"--lora {spec.name}: given twice (here or in KVMESH_LORAS)")
        path = str(Path(spec.path).expanduser().resolve())
        try:
            config = load_config(spec.base, Path(common.state_dir), models=common.models)
        except ModelError as err:
            raise ValueError(f"--lora {spec.name}: base model {spec.base}: {err}") from None
        try:
            check_adapter(path, config)
        except LoraError as err:
            raise ValueError(f"--lora {spec.name}: {err}") from None
        loras[spec.name] = f"{spec.base}:{path}"
    return common.model_copy(update={"loras": loras})


def run(args: argparse.Namespace) -> int:
    unset = 0 if args.upstream else 1  # (in front of servers of its own: no workers unasked)
    asked = {"prefill": args.prefill, "decode": args.decode, "encoder": args.encoder}
    counts = {role: unset if n is None else n for role, n in asked.items()}
    for role, n in counts.items():
        if not 0 <= n <= 64:
            print(f"kvmesh up: --{role} must be between 0 and 64 (got {n})", file=sys.stderr)
            return 2
    if not 1 <= args.routers <= 16:
        print(
            f"kvmesh up: --routers must be between 1 and 16 (got {args.routers})", file=sys.stderr
        )
        return 2
    if not 1 <= args.nats_cluster <= 5:
        print(
            f"kvmesh up: --nats-cluster must be between 1 and 5 (got {args.nats_cluster})",
            file=sys.stderr,
        )
        return 2
    counts["router"] = args.routers
    try:
        common = load_settings(CommonSettings)
        router = load_settings(RouterSettings)
        if args.upstream:
            router = RouterSettings.model_validate(
                {**router.model_dump(), "upstreams": [*router.upstreams, *args.upstream]}
            )
    except (SettingsError, ValueError) as err:
        print(f"kvmesh up: {err}", file=sys.stderr)
        return 2
    setup_logging(common.log_level)
    try:
        common, models = with_models(common, args.model)
        common = with_loras(common, args.lora)
    except ValueError as err:
        print(f"kvmesh up: {err}", file=sys.stderr)
        return 2
    decider = None
    if args.autoscale is not None:
        try:
            low, high = bounds(args.autoscale)
        except ValueError as err:
            print(f"kvmesh up: {err}", file=sys.stderr)
            return 2
        if len(models) > 1:
            print("kvmesh up: --autoscale serves one model (the plan is per mesh)", file=sys.stderr)
            return 2
        if not args.autoscale_every > 0:
            print(
                f"kvmesh up: --autoscale-every: above 0 seconds (got {args.autoscale_every:g})",
                file=sys.stderr,
            )
            return 2
        counts["prefill"] = min(high, max(low, counts["prefill"]))
        counts["decode"] = min(high, max(low, counts["decode"]))
        cooldown = 6 * args.autoscale_every
        decider = Decider(low, high, Hysteresis(cooldown_s=cooldown))
    try:
        stack = Stack(
            common,
            router,
            counts,
            args.tls,
            args.nats_cluster,
            models,
            decider,
            args.autoscale_every,
        )
        return uvloop.run(stack.run(args.timeout))
    except NatsServerError as err:
        print(f"kvmesh up: {err}", file=sys.stderr)
        return 1
