"""`kvmesh model`: the models a mesh can serve, and a GGUF model as a Hugging Face directory.

    kvmesh model list
    kvmesh model check NAME
    kvmesh model export smollm2-135m-instruct --to ./smollm2-hf [--dtype float16]

``list`` shows every model name with where its files are (the built-ins, and KVMESH_MODELS /
``[models]``); ``check`` reads a model's files as a worker would at start and says what is
wrong, if anything (exit 2); ``export`` writes a GGUF model (the bundled SmolLM2, or one by
path) as a Hugging Face directory for the engines that take those.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.model.catalog import ModelError, resolve
from shared.model.export import DTYPES, export
from shared.model.text import check_model, model_names
from shared.settings import CommonSettings, SettingsError, load_settings


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("model", help="the models a mesh serves; export to Hugging Face")
    sub = p.add_subparsers(dest="model_command", required=True)
    sub.add_parser("list", help="every model name and where its files are").set_defaults(
        run=run_list
    )
    check = sub.add_parser("check", help="read a model's files as a worker would at start")
    check.add_argument("name")
    check.set_defaults(run=run_check)
    out = sub.add_parser("export", help="write a GGUF model as a Hugging Face directory")
    out.add_argument("name", help="a model name (see kvmesh model list)")
    out.add_argument("--to", type=Path, required=True, help="the directory to write")
    out.add_argument("--dtype", default="float32", choices=list(DTYPES))
    out.set_defaults(run=run_export)


def _common() -> CommonSettings:
    return load_settings(CommonSettings)


def _fail(message: str) -> int:
    print(f"kvmesh model: {message}", file=sys.stderr)
    return 2


def run_list(args: argparse.Namespace) -> int:
    try:
        common = _common()
    except SettingsError as err:
        return _fail(str(err))
    for name in model_names(common.models):
        where = common.models.get(name) or resolve(name, common.models).kind
        print(f"{name:32}  {where}")
    return 0


def run_check(args: argparse.Namespace) -> int:
    try:
        common = _common()
        source = check_model(args.name, Path(common.state_dir), common.models)
    except (SettingsError, ModelError) as err:
        return _fail(str(err))
    print(f"{args.name}: servable ({source.kind}{f', {source.path}' if source.path else ''})")
    return 0


def run_export(args: argparse.Namespace) -> int:
    try:
        common = _common()
        source = resolve(args.name, common.models)
        to = export(source, Path(common.state_dir), args.to, args.dtype)
    except (SettingsError, ModelError) as err:
        return _fail(str(err))
    print(f"{args.name} written to {to} (a Hugging Face directory)")
    return 0
