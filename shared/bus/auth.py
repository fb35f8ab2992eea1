"""Who may do what on the bus: one NATS identity per role, each limited to its role's subjects.

An identity is an NKey (Ed25519): the role's secret (``nats-<role>`` in the secrets dir) is
its seed, so a service reads only its own role's file, and nats-server's configuration holds
public keys only (``kvmesh.natsconf`` writes it). What each role may publish and subscribe to
is listed here, next to nothing else: a worker cannot publish another role's KV events, a
router's tasks or cachemeta's answers, nor read other roles' replies (each role has its own
inbox prefix), and whoever has no identity is refused at connect.

External NATS servers are reached with what the settings give instead (a credentials file,
user and password, a token, TLS files): ``connect_options`` turns them into nats-py's
arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys

from shared.bus import subjects
from shared.security.secret import load_or_create
from shared.security.tls import client_context

# The roles with an identity: the five services, and `kvmesh` commands (status, up).
ROLES = ("router", "prefill", "decode", "encoder", "cachemeta", "cli")


def inbox_prefix(role: str) -> str:
    """Where a role's request replies and JetStream deliveries arrive: its own subjects."""
    return f"_INBOX.{role}"


def secret_name(role: str) -> str:
    return f"nats-{role}"


def seed(secrets_dir: Path, role: str) -> str:
    """The role's NKey seed ("SU..."), from its secret (made now if there is none)."""
    raw = load_or_create(secrets_dir, secret_name(role))
    return nkeys.encode_seed(raw, nkeys.PREFIX_BYTE_USER).decode()


def public_key(secrets_dir: Path, role: str) -> str:
    """The role's NKey public key ("U..."), what nats-server's configuration lists."""
    return nkeys.from_seed(bytearray(seed(secrets_dir, role).encode())).public_key.decode()


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool  # may answer the requests it receives (nats-server's allow_responses)


# -- JetStream: the API subjects each use of a stream needs ---------------------------------

JS = "$JS.API"


def _stream_owner(stream: str) -> list[str]:
    """Creates the stream, sets its configuration, purges it."""
    return [f"{JS}.STREAM.{op}.{stream}" for op in ("INFO", "CREATE", "UPDATE", "PURGE")]


def _stream_creator(stream: str) -> list[str]:
    """Creates the stream when it is not there yet (with defaults its owner replaces)."""
    return [f"{JS}.STREAM.{op}.{stream}" for op in ("INFO", "CREATE")]


def _stream_reader(stream: str) -> list[str]:
    """Reads with ordered consumers, pull consumers (``Bus.latest``) and direct gets."""
    return [
        f"{JS}.STREAM.INFO.{stream}",
        f"{JS}.STREAM.NAMES",
        f"{JS}.CONSUMER.CREATE.{stream}",
        f"{JS}.CONSUMER.CREATE.{stream}.>",
        f"{JS}.CONSUMER.DELETE.{stream}.>",
        f"{JS}.CONSUMER.MSG.NEXT.{stream}.>",
        f"{JS}.DIRECT.GET.{stream}",
        f"{JS}.DIRECT.GET.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _durable_consumer(stream: str) -> list[str]:
    """Owns a durable consumer and acks what it handled."""
    return [
        f"{JS}.CONSUMER.INFO.{stream}.>",
        f"{JS}.CONSUMER.DURABLE.CREATE.{stream}.>",
        f"$JS.ACK.{stream}.>",
    ]


def _bucket(stream: str, prefix: str) -> list[str]:
    """Owns a key-value bucket or an object store (a stream under the hood): writes its
    subjects, reads its entries and watches them, purges what is deleted."""
    return [
        f"{prefix}.>",
        *_stream_owner(stream),
        *_stream_reader(stream),
        f"{JS}.STREAM.MSG.GET.{stream}",
        f"{JS}.CONSUMER.INFO.{stream}.>",
    ]


def _worker(role: str) -> Permissions:
    publish = [
        subjects.heartbeat(role),
        subjects.kv_events(role),
        *_stream_creator(subjects.KV_EVENTS_STREAM),
        subjects.reply_all(),  # the token stream of the requests it serves
    ]
    subscribe = [
        subjects.tasks_all(role),
        subjects.CANCEL,
        subjects.SPANS_QUERY,
        subjects.KV_RESYNC_ALL,  # (asked to republish its memory tier's blocks)
    ]
    # Images' embeddings, from the encoder's stream (decode prefills short prompts itself).
    publish += _stream_reader(subjects.EMBEDS_STREAM)
    # The LoRA adapters loaded at run time, followed (routers write them).
    publish += [*_stream_creator(subjects.LORAS_STREAM), *_stream_reader(subjects.LORAS_STREAM)]
    # P/D with engines that own their KV: prefill hands the rest of a request to decode (with
    # the router's handoff token, which decode checks), on a subject of its own.
    if role == "prefill":
        publish.append(subjects.handovers_all())
    else:
        subscribe.append(subjects.handovers_all())
    return Permissions(tuple(publish), tuple(subscribe), responds=True)


def permissions(role: str) -> Permissions:
    """What ``role``'s identity may publish and subscribe to, besides its own inbox. A
    service also asks who holds its id, and answers for it (``subjects.whois``)."""
    p = _permissions(role)
    if role == "cli":
        return p
    whois = subjects.WHOIS_ALL
    return Permissions((*p.publish, whois), (*p.subscribe, whois), p.responds)


def _permissions(role: str) -> Permissions:
    if role in ("prefill", "decode"):
        return _worker(role)
    if role == "router":
        publish = [
            subjects.heartbeat(role),
            subjects.tasks_all("prefill"),
            subjects.tasks_all("decode"),
            subjects.CANCEL,
            subjects.ENCODE,
            # Its own block index: the KV event stream followed from cachemeta's snapshot;
            # the blocks it used published (touches); stale workers asked to resync.
            subjects.kv_events(role),
            subjects.KV_RESYNC_ALL,
            *_stream_creator(subjects.KV_EVENTS_STREAM),
            *_stream_reader(subjects.KV_EVENTS_STREAM),
            *_stream_creator(subjects.KV_INDEX_STREAM),
            *_stream_reader(subjects.KV_INDEX_STREAM),
            subjects.STATS_ALL,
            subjects.SPANS_QUERY,
            *_stream_owner(subjects.STATS_STREAM),
            *_stream_reader(subjects.STATS_STREAM),
            # Batch work: files, batches' records, their lines' results.
            *_bucket(f"OBJ_{subjects.FILES_BUCKET}", f"$O.{subjects.FILES_BUCKET}"),
            *_bucket(f"KV_{subjects.BATCHES_BUCKET}", f"$KV.{subjects.BATCHES_BUCKET}"),
            *_bucket(f"KV_{subjects.RESULTS_BUCKET}", f"$KV.{subjects.RESULTS_BUCKET}"),
            # LoRA adapters loaded and unloaded at run time (the operator's, through any router).
            subjects.LORAS_ALL,
            *_stream_owner(subjects.LORAS_STREAM),
            *_stream_reader(subjects.LORAS_STREAM),
        ]
        subscribe = [
            subjects.HEARTBEAT_ALL,
            subjects.SYS_DISCONNECT,  # (imported from the server's system account)
            subjects.reply_all(),
            subjects.ROUTER_REGISTRY,
            subjects.ROUTER_PLAN,
            subjects.SPANS_QUERY,
        ]
        return Permissions(tuple(publish), tuple(subscribe), responds=True)
    if role == "encoder":
        publish = [
            subjects.heartbeat(role),
            subjects.EMBEDS_ALL,
            *_stream_owner(subjects.EMBEDS_STREAM),
        ]
        return Permissions(tuple(publish), (subjects.ENCODE, subjects.SPANS_QUERY), responds=True)
    if role == "cachemeta":
        publish = [
            subjects.heartbeat(role),
            subjects.kv_events(role),
            *_stream_owner(subjects.KV_EVENTS_STREAM),
            *_stream_reader(subjects.KV_EVENTS_STREAM),
            *_durable_consumer(subjects.KV_EVENTS_STREAM),
            subjects.KV_RESYNC_ALL,
            subjects.KV_INDEX_ALL,  # its snapshot, for routers
            *_stream_owner(subjects.KV_INDEX_STREAM),
        ]
        subscribe = [subjects.CACHEMETA_LOOKUP, subjects.HEARTBEAT_ALL, subjects.SPANS_QUERY]
        return Permissions(tuple(publish), tuple(subscribe), responds=True)
    if role == "cli":  # `kvmesh status` and `kvmesh up` ask a router for its registry (and
        # `kvmesh up --autoscale` for its plan); tools ask cachemeta where blocks are
        return Permissions(
            (subjects.ROUTER_REGISTRY, subjects.ROUTER_PLAN, subjects.CACHEMETA_LOOKUP),
            (),
            responds=False,
        )
    raise ValueError(f"no NATS identity for role {role!r}; roles: {', '.join(ROLES)}")


# -- a client's side: nats-py's connect arguments from the settings -------------------------


def identity(secrets_dir: Path, role: str) -> dict[str, Any]:
    """nats-py's ``connect`` arguments that make a client ``role`` on a mesh's own NATS."""
    return {"nkeys_seed_str": seed(secrets_dir, role), "inbox_prefix": inbox_prefix(role)}


def connect_options(common: Any, role: str) -> dict[str, Any]:
    """nats-py's ``connect`` arguments for ``role`` from CommonSettings: the credentials the
    settings name, else the role's NKey from the secrets dir; TLS when its files are set or
    the URL says ``tls://``."""
    options: dict[str, Any] = {"inbox_prefix": inbox_prefix(role)}
    if common.nats_creds_file is not None:
        options["user_credentials"] = str(common.nats_creds_file)
    elif common.nats_user:
        options["user"] = common.nats_user
        options["password"] = common.nats_password.get_secret_value()
    elif common.nats_token.get_secret_value():
        options["token"] = common.nats_token.get_secret_value()
    else:
        options.update(identity(common.resolved_secrets_dir, role))
    ca, cert, key = common.nats_tls_files
    if ca or cert or any(u.startswith("tls://") for u in common.nats_servers):
        options["tls"] = client_context(ca, cert, key)
    return options
