"""`kvmesh keys`: make, list and revoke API keys in the keys file the router reads.

    kvmesh keys add --tenant acme [--admin] [--rpm 600] [--tpm 2000000] [--concurrency 32]
                    [--choices 4] [--tier-ceiling default] [--tier-default flex] [--weight 2]
                    [--pin-ttl-s 900] [--pin-bytes 1073741824]
    kvmesh keys list
    kvmesh keys revoke key_3f9a0c1d

The file is KVMESH_ROUTER_KEYS_FILE, else <state dir>/keys.json (give the router the same
path). A new key is printed once, on stdout; the file keeps only its hash. A running router
reads the file again when it changes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shared.security.keys import LIMITS, MAX_WEIGHT, TIERS, KeysFile, KeysFileError, new_key
from shared.settings import CommonSettings


def default_file() -> Path:
    env = os.environ.get("KVMESH_ROUTER_KEYS_FILE")
    return Path(env) if env else CommonSettings().state_dir / "keys.json"


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("keys", help="make, list and revoke API keys")
    p.add_argument("--file", type=Path, default=None, help="the keys file (default: see above)")
    sub = p.add_subparsers(dest="action", required=True)
    add = sub.add_parser("add", help="make a key (printed once)")
    add.add_argument("--tenant", required=True, help="the tenant the key speaks for")
    add.add_argument("--admin", action="store_true", help="may read the operator's endpoints")
    for name, what in (
        ("rpm", "requests per minute"),
        ("tpm", "input tokens per minute"),
        ("concurrency", "requests in progress at once"),
        ("choices", "answers per prompt (n, best_of; 0: the router's max_choices)"),
    ):
        add.add_argument(f"--{name}", type=int, default=0, help=f"{what} at most (0: no limit)")
    add.add_argument(
        "--tier-ceiling",
        choices=TIERS,
        default="",
        help="the highest class (service_tier) its requests may ask for (default: priority)",
    )
    add.add_argument(
        "--tier-default",
        choices=TIERS,
        default="",
        help="the class of its requests that ask for none (default: default)",
    )
    add.add_argument(
        "--pin-ttl-s",
        type=int,
        default=0,
        help="a conversation's KV pinned for at most this long (0: the router's bound)",
    )
    add.add_argument(
        "--pin-bytes",
        type=int,
        default=0,
        help="KV its tenant may have pinned at once (0: the router's bound)",
    )
    add.add_argument(
        "--weight",
        type=int,
        default=0,
        help=f"its tenant's weight in a class's fair share, 1-{MAX_WEIGHT} (default: 1)",
    )
    sub.add_parser("list", help="the keys, without secrets")
    revoke = sub.add_parser("revoke", help="refuse a key from now on")
    revoke.add_argument("key_id")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    path = args.file or default_file()
    try:
        keys = KeysFile.read(path)
        if args.action == "add":
            for name in LIMITS:
                if getattr(args, name) < 0:
                    raise KeysFileError(f"--{name}: at least 0")
            limits = {name: getattr(args, name) for name in LIMITS}
            tiers = {
                "tier_ceiling": args.tier_ceiling,
                "tier_default": args.tier_default,
                "pin_ttl_s": args.pin_ttl_s,
                "pin_bytes": args.pin_bytes,
            }
            role = "admin" if args.admin else "user"
            key, entry = new_key(args.tenant, role, weight=args.weight, **limits, **tiers)
            keys.add(entry)
            keys.write(path)
            print(key)
            print(
                f"{entry.id} for tenant {entry.tenant} ({entry.role}) added to {path}; "
                "the key is shown only now",
                file=sys.stderr,
            )
        elif args.action == "list":
            print(
                f"{'id':<14}{'tenant':<20}{'role':<7}{'rpm':>8}{'tpm':>10}{'conc':>6}"
                f"  {'tiers':<18}{'weight':>6}  state"
            )
            for k in keys.keys:
                state = "revoked" if k.revoked else "active"
                tiers = f"{k.default_tier} (≤ {k.ceiling})"
                print(
                    f"{k.id:<14}{k.tenant:<20}{k.role:<7}{k.rpm:>8}{k.tpm:>10}"
                    f"{k.concurrency:>6}  {tiers:<18}{k.weight or 1:>6}  {state}"
                )
        else:
            entry = keys.revoke(args.key_id)
            keys.write(path)
            print(f"{entry.id} revoked in {path}", file=sys.stderr)
    except KeysFileError as err:
        print(f"kvmesh keys: {err}", file=sys.stderr)
        return 2
    return 0
