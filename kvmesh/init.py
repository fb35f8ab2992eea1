"""`kvmesh init`: a mesh's secrets and nats-server's configuration under the state dir.

`kvmesh up` does this at every start; docker-compose runs it once before NATS and the
services (they share the state dir's volume), and on Kubernetes a Job runs it and puts what it
wrote into Secrets (deploy/kubernetes/). It makes the secrets every process of a mesh shares
(the tenant salt, the KV hand-over's key), each role's NATS identity (an NKey from a secret in
the secrets dir), writes <state_dir>/nats/server.conf (kvmesh/nats.conf, the
identities' public keys and permissions, TLS with ``--tls``) and, with ``--tls``, a local CA
and every role's certificate under <state_dir>/tls. Nothing that exists is replaced, except
the server configuration (rewritten from the code's permissions) and expiring certificates.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from kvmesh.natsconf import write_server_config
from kvmesh.tls import MeshTls, ensure_mesh_tls
from shared.security.handoff import HANDOFF_SECRET
from shared.security.salt import SALT_SECRET
from shared.security.secret import load_or_create
from shared.settings import CommonSettings, SettingsError, load_settings


@dataclass(frozen=True)
class Prepared:
    nats_config: Path
    tls: MeshTls | None


# The secrets every process of a mesh must share, whatever host it runs on: the tenant salt
# (one tenant's block hashes are the same on every router) and the KV hand-over's key.
MESH_SECRETS = (SALT_SECRET, HANDOFF_SECRET)


def prepare(common: CommonSettings, tls: bool, hosts: tuple[str, ...] = ()) -> Prepared:
    for name in MESH_SECRETS:  # (NATS identities are made below, with the configuration)
        load_or_create(common.resolved_secrets_dir, name)
    mesh_tls = ensure_mesh_tls(common.state_dir / "tls", hosts) if tls else None
    server_tls = None
    if mesh_tls is not None:
        nats = mesh_tls.certs["nats"]
        server_tls = (mesh_tls.ca, nats.cert, nats.key)
    config = write_server_config(
        common.state_dir / "nats" / "server.conf", common.resolved_secrets_dir, server_tls
    )
    return Prepared(config, mesh_tls)


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("init", help="write the mesh's secrets and NATS configuration")
    p.add_argument("--tls", action="store_true", help="also a local CA and certificates")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="(with --tls) an address or name the certificates also name: each host of a "
        "mesh over several (repeatable)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        common = load_settings(CommonSettings)
    except SettingsError as err:
        print(f"kvmesh init: {err}", file=sys.stderr)
        return 2
    done = prepare(common, args.tls, tuple(args.host))
    print(f"NATS configuration: {done.nats_config}")
    print(f"secrets (one per role, mode 0600): {common.resolved_secrets_dir}")
    if done.tls is not None:
        print(f"TLS: CA {done.tls.ca}, certificates beside it")
    return 0
