"""`kvmesh` entry point: parse the command line, hand over to the subcommand."""

from __future__ import annotations

import argparse
import sys

from kvmesh import batch, eplb, init, keys, model, plan, sim, status, trace, up


def main(argv: list[str] | None = None) -> int:
    args = cli().parse_args(argv)
    return args.run(args)


def cli() -> argparse.ArgumentParser:
    """The command line's parser, every subcommand in it."""
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    up.add_parser(commands)
    status.add_parser(commands)
    sim.add_parser(commands)
    plan.add_parser(commands)
    trace.add_parser(commands)
    keys.add_parser(commands)
    init.add_parser(commands)
    batch.add_parser(commands)
    eplb.add_parser(commands)
    model.add_parser(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
