"""`kvmesh model`: the models a mesh can serve, and a GGUF model as a Hugging Face directory.

    kvmesh model list
    kvmesh model check NAME
    kvmesh model export smollm2-135m-instruct --to ./smollm2-hf [--dtype float16]
    kvmesh model vllm-serve smollm2-135m-instruct --port 8001 --events-port 5557 [--kv-store DIR]

``list`` shows every model name with where its files are (the built-ins, and KVMESH_MODELS /
``[models]``); ``check`` reads a model's files as a worker would at start and says what is
wrong, if anything (exit 2); ``export`` writes a GGUF model (the bundled SmolLM2, or one by
path) as a Hugging Face directory for the engines that take those; ``vllm-serve`` prints the
``vllm serve`` command of a server a kvmesh router can route to by its cache (its model exported
under the state dir, its KV events on a port, kvmesh's storage tier as its connector).
"""

from __future__ import annotations

import argparse
import shlex
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
    serve = sub.add_parser(
        "vllm-serve", help="print the vllm serve command of a server kvmesh routes to by its cache"
    )
    serve.add_argument("name", help="a model name (see kvmesh model list)")
    serve.add_argument("--port", type=int, default=8001, help="its API port")
    serve.add_argument("--events-port", type=int, default=5557, help="its KV events (and +1)")
    serve.add_argument(
        "--kv-store", type=Path, help="kvmesh's storage tier, by its connector (turns move)"
    )
    serve.add_argument("--eager", action="store_true", help="no compiled graphs (CPUs)")
    serve.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the server's weights and KV (bfloat16 on a GPU)",
    )
    serve.set_defaults(run=run_vllm_serve)


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


def run_vllm_serve(args: argparse.Namespace) -> int:
    from shared.engine.vllm.serve import serve_command
    from shared.model.export import hf_directory
    from shared.model.text import text_of

    try:
        common = _common()
        state = Path(common.state_dir)
        source = check_model(args.name, state, common.models)
        config = text_of(source, state).config
        directory = hf_directory(source, config, state).resolve()
    except (SettingsError, ModelError) as err:
        return _fail(str(err))
    store = args.kv_store.resolve() if args.kv_store else None
    argv = serve_command(
        directory,
        args.name,
        args.port,
        args.events_port,
        config.fingerprint,
        store,
        eager=args.eager,
        dtype=args.dtype,
    )
    print(shlex.join(argv))
    return 0
