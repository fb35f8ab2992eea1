"""Every NATS subject kvmesh uses, in one place.

Subjects are dot-separated and start with ``kvmesh.``; the last token of a per-role or
per-request subject is filled in by the functions here, never by string formatting elsewhere.
"""

from __future__ import annotations

PREFIX = "kvmesh"


def _token(name: str) -> str:
    """One subject token from an id: no dots (hostnames have them), wildcards or spaces."""
    return "".join("_" if c in ".*> \t" else c for c in name) or "_"


# Heartbeats and load reports: every service publishes on heartbeat(role) every interval.
HEARTBEAT_ALL = f"{PREFIX}.heartbeat.>"


def heartbeat(role: str) -> str:
    return f"{PREFIX}.heartbeat.{role}"


# A service's id is its own: a process starting asks who holds it (request/reply; nobody
# answers when the id is free) and then answers for it.
def whois(service_id: str) -> str:
    return f"{PREFIX}.whois.{_token(service_id)}"


WHOIS_ALL = f"{PREFIX}.whois.*"


# nats-server's own word that a client's connection closed (its system account's DISCONNECT
# advisory, imported into the mesh's account under this subject: kvmesh/natsconf.py). Routers
# drop a worker at once on it, not three heartbeats later.
SYS_DISCONNECT = f"{PREFIX}.sys.disconnect"

# Request/reply: a router's view of the live workers (served by every router, queue group).
ROUTER_REGISTRY = f"{PREFIX}.router.registry"
# ...and the pools its recent traffic needs (``kvmesh up --autoscale`` acts on it).
ROUTER_PLAN = f"{PREFIX}.router.plan"
ROUTER_QUEUE = "router"


# The request path. A router sends a GenerateTask to the worker it picked (request/reply: the
# reply is a TaskAck); tokens come back on replies(router_id) as TokenEvents messages: one
# subject per router, each message a list of events of any of its requests (a decode worker
# sends one per step for all the requests of that router it serves).
def tasks(role: str, service_id: str) -> str:
    return f"{PREFIX}.{role}.{_token(service_id)}.tasks"


def tasks_all(role: str) -> str:
    """Every worker's task subject of a role."""
    return f"{PREFIX}.{role}.*.tasks"


# P/D between workers whose engines own their KV: a prefill worker hands a request, its
# prompt's KV in the storage tier, to the decode worker the router chose (request/reply: a
# TaskAck). Its own subject: a decode worker's task subject stays the routers' alone.
def handovers(decode_id: str) -> str:
    return f"{PREFIX}.decode.{_token(decode_id)}.handover"


def handovers_all() -> str:
    return f"{PREFIX}.decode.*.handover"


def reply_all() -> str:
    """Every router's reply subject (what the workers that serve requests may publish on)."""
    return f"{PREFIX}.reply.>"


def replies(router_id: str) -> str:
    """One router's reply subject (it subscribes once and sorts events by request)."""
    return f"{PREFIX}.reply.{_token(router_id)}"


# A cancelled request: every prefill and decode worker listens, the one holding it acts.
CANCEL = f"{PREFIX}.cancel"


# KV events: every block stored at or removed from a location, on a JetStream stream that
# cachemeta consumes with a durable consumer (so it loses none across restarts) and every
# router follows (its own index). Each role publishes on its own subject (the bus lets it
# publish on no other): workers their memory tiers' and the storage tier's stores, routers the
# blocks they used (touches), cachemeta the storage tier's removals.
KV_EVENTS_STREAM = "KVMESH_KV_EVENTS"
KV_EVENTS_ALL = f"{PREFIX}.kv.events.>"


def kv_events(role: str) -> str:
    return f"{PREFIX}.kv.events.{role}"


# A worker whose events did not all come is asked to republish what its memory tier holds
# (by the routers and cachemeta, which keep the index).
def kv_resync(service_id: str) -> str:
    return f"{PREFIX}.kv.resync.{_token(service_id)}"


KV_RESYNC_ALL = f"{PREFIX}.kv.resync.*"

# Cachemeta's snapshot of the index (and the stream position it reflects), where routers
# start from: one message (in parts) on a last-per-subject stream.
KV_INDEX_STREAM = "KVMESH_KV_INDEX"
KV_INDEX_ALL = f"{PREFIX}.kvindex.>"
KV_INDEX_SNAPSHOT = f"{PREFIX}.kvindex.snapshot"


# Request/reply: how many leading blocks of a prompt each location holds (cachemeta answers:
# for tools and tests; routers look up in their own index).
CACHEMETA_LOOKUP = f"{PREFIX}.cachemeta.lookup"
CACHEMETA_QUEUE = "cachemeta"


# Images: the router sends each image to the encoder pool (request/reply, a queue group);
# the encoder puts its embeddings on the embeddings stream (in memory, a short max age), one
# subject per model and image, where the prefill worker that computes the request reads them.
ENCODE = f"{PREFIX}.encoder.encode"
ENCODER_QUEUE = "encoder"
EMBEDS_STREAM = "KVMESH_EMBEDS"
EMBEDS_ALL = f"{PREFIX}.embeds.>"


def embeds(model: str, image_hash: str) -> str:
    return f"{PREFIX}.embeds.{_token(model)}.{_token(image_hash)}"


# The operator's statistics: each router shares its per-minute sums on a JetStream stream (the
# last message per router and minute kept, for a day), so every router reports the whole mesh
# and a restarted router finds its earlier minutes.
STATS_STREAM = "KVMESH_STATS"
STATS_ALL = f"{PREFIX}.stats.>"


def stats(router_id: str, minute: int) -> str:
    return f"{PREFIX}.stats.{_token(router_id)}.{minute}"


# Batch work (services/router/batch/): uploaded and written files in an object
# store; batches' records and their lines' results in key-value buckets. Routers only.
FILES_BUCKET = "KVMESH_FILES"
BATCHES_BUCKET = "KVMESH_BATCHES"
RESULTS_BUCKET = "KVMESH_BATCH_RESULTS"


# Request/reply to every service at once (no queue group): its recent spans of a trace (the
# operator page's waterfall); the asker gathers the replies for a moment.
SPANS_QUERY = f"{PREFIX}.spans.query"


# LoRA adapters loaded at run time (shared/bus/adapters.py): one message per adapter name, the
# last kept, on a stream routers write (the operator's load and unload) and every router and
# worker follows from its start.
LORAS_STREAM = "KVMESH_LORAS"
LORAS_ALL = f"{PREFIX}.lora.>"


def lora(name: str) -> str:
    return f"{PREFIX}.lora.{name.encode().hex()}"  # (names have dots and slashes)
