"""`kvmesh batch IN.jsonl -o OUT.jsonl`: a batch file through a mesh's Batches API.

Against a running mesh (--url, or the router's port from the settings) or, when none answers
there, a stack it starts itself (`kvmesh up`) and stops at the end. The answers go to OUT
(one line each, OpenAI's batch output format), the requests that failed to OUT's
``.errors.jsonl`` next to it. Resumable: the lines whose ``custom_id`` is in OUT already are
not sent again, and a batch still running from an interrupted run (its id is kept in
``OUT.batch``) is waited for instead of sent twice. Ctrl-C cancels the batch and keeps the
answers it got.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from shared.settings import SettingsError, load_settings

TERMINAL = ("completed", "failed", "expired", "cancelled")


class BatchCliError(Exception):
    pass


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("batch", help="run a JSONL batch file through the Batches API")
    p.add_argument("input", type=Path, help="OpenAI batch lines: {custom_id, method, url, body}")
    p.add_argument("-o", "--output", type=Path, required=True, help="answers, appended")
    p.add_argument("--url", default="", help="a router's URL (default: the local one)")
    p.add_argument(
        "--key", default=os.environ.get("KVMESH_API_KEY", ""), help="API key ($KVMESH_API_KEY)"
    )
    p.add_argument("--window", default="24h", help="completion window (24h, or e.g. 30m)")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between status checks")
    p.add_argument(
        "--no-start", action="store_true", help="fail when no mesh answers (never start one)"
    )
    p.set_defaults(run=run)


class Client:
    """The few calls this needs, over plain HTTP."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def call(self, method: str, path: str, body: bytes | None = None, ctype: str = "") -> bytes:
        headers = dict(self.headers)
        if ctype:
            headers["Content-Type"] = ctype
        req = urllib.request.Request(self.url + path, body, headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")
            with contextlib.suppress(ValueError, KeyError, TypeError):
                detail = json.loads(detail)["error"]["message"]
            raise BatchCliError(f"{method} {path}: HTTP {err.code}: {detail}") from None

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        return json.loads(self.call(method, path, data, "application/json" if data else ""))

    def upload(self, name: str, data: bytes) -> str:
        boundary = secrets.token_hex(16)
        body = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                f"--{boundary}\r\nContent-Disposition: form-data; "
                f'name="file"; filename="{name}"\r\n'
                "Content-Type: application/jsonl\r\n\r\n"
            ).encode()
            + data
            + f"\r\n--{boundary}--\r\n".encode()
        )
        ctype = f"multipart/form-data; boundary={boundary}"
        return json.loads(self.call("POST", "/v1/files", body, ctype))["id"]

    def answers(self) -> bool:
        try:
            self.call("GET", "/v1/models")
            return True
        except (OSError, BatchCliError):
            return False


def done_ids(path: Path) -> set[str]:
    """custom_ids already answered in an output file (a torn last line is ignored)."""
    found: set[str] = set()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                found.add(json.loads(line)["custom_id"])
            except (ValueError, KeyError, TypeError):
                continue
    return found


def pending_lines(path: Path, done: set[str]) -> tuple[list[str], str]:
    """The input's lines not answered yet, and their endpoint (every line must share it)."""
    lines, endpoints = [], set()
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
            custom_id, url = obj["custom_id"], obj["url"]
        except (ValueError, KeyError, TypeError):
            raise BatchCliError(f"{path}:{number}: not a batch line (custom_id, url)") from None
        endpoints.add(url)
        if custom_id not in done:
            lines.append(raw)
    if len(endpoints) > 1:
        raise BatchCliError(f"{path}: lines for several endpoints: {sorted(endpoints)}")
    return lines, next(iter(endpoints), "/v1/chat/completions")


def progress(batch: dict) -> None:
    counts = batch.get("request_counts") or {}
    total = counts.get("total", 0)
    done = counts.get("completed", 0) + counts.get("failed", 0)
    width = 30
    filled = width * done // max(1, total)
    print(
        f"\r{batch['status']:<12} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}"
        f" ({counts.get('failed', 0)} failed)",
        end="\n" if batch["status"] in TERMINAL else "",
        file=sys.stderr,
        flush=True,
    )


def wait(client: Client, batch_id: str, poll_s: float) -> dict:
    try:
        while True:
            batch = client.json("GET", f"/v1/batches/{batch_id}")
            progress(batch)
            if batch["status"] in TERMINAL:
                return batch
            time.sleep(poll_s)
    except KeyboardInterrupt:
        print("\ncancelling the batch (its answers so far are kept)", file=sys.stderr)
        client.json("POST", f"/v1/batches/{batch_id}/cancel")
        while (batch := client.json("GET", f"/v1/batches/{batch_id}"))["status"] not in TERMINAL:
            time.sleep(poll_s)
        return batch


def collect(client: Client, batch: dict, output: Path) -> tuple[int, int]:
    """Append the batch's answers to ``output`` and its failures to the errors file, each
    custom_id once (one already in ``output`` is skipped)."""
    done = done_ids(output)
    errors_path = output.with_suffix(".errors.jsonl")
    written = [0, 0]
    for k, (key, path) in enumerate((("output_file_id", output), ("error_file_id", errors_path))):
        if not batch.get(key):
            continue
        content = client.call("GET", f"/v1/files/{batch[key]}/content").decode()
        with path.open("a") as out:
            for line in content.splitlines():
                if line.strip() and json.loads(line)["custom_id"] not in done:
                    out.write(line + "\n")
                    written[k] += 1
    return written[0], written[1]


def local_url() -> str:
    from services.router.settings import RouterSettings

    try:
        settings = load_settings(RouterSettings)
    except SettingsError:
        return "http://127.0.0.1:8000"
    return f"http://127.0.0.1:{settings.http_port}"


def start_stack(url: str) -> subprocess.Popen:
    print(f"no mesh answers at {url}: starting one (kvmesh up)", file=sys.stderr)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh", "up"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    client = Client(url, "")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BatchCliError(f"kvmesh up exited ({proc.returncode}); try it alone")
        try:
            if json.loads(client.call("GET", "/v1/models"))["data"]:
                return proc
        except (OSError, BatchCliError, ValueError):
            pass
        time.sleep(1)
    raise BatchCliError("the stack was not ready within 600 s")


def run(args: argparse.Namespace) -> int:
    url = args.url or local_url()
    client = Client(url, args.key)
    stack = None
    try:
        if not client.answers():
            if args.no_start or args.url:
                raise BatchCliError(f"no mesh answers at {url}")
            stack = start_stack(url)
        state = args.output.with_suffix(args.output.suffix + ".batch")
        batch_id = state.read_text().strip() if state.exists() else ""
        if not batch_id:
            lines, endpoint = pending_lines(args.input, done_ids(args.output))
            if not lines:
                print(f"every line of {args.input} is answered in {args.output}", file=sys.stderr)
                return 0
            file_id = client.upload(args.input.name, "\n".join(lines).encode() + b"\n")
            batch = client.json(
                "POST",
                "/v1/batches",
                {"input_file_id": file_id, "endpoint": endpoint, "completion_window": args.window},
            )
            batch_id = batch["id"]
            state.write_text(batch_id)
            print(f"batch {batch_id}: {len(lines)} requests to {endpoint}", file=sys.stderr)
        else:
            print(f"waiting for batch {batch_id} (from an earlier run)", file=sys.stderr)
        batch = wait(client, batch_id, args.poll)
        if batch["status"] == "failed":
            errors = (batch.get("errors") or {}).get("data") or []
            for e in errors:
                print(f"  line {e.get('line')}: {e.get('message')}", file=sys.stderr)
            state.unlink(missing_ok=True)
            return 1
        answered, failed = collect(client, batch, args.output)
        state.unlink(missing_ok=True)
        print(
            f"batch {batch_id} {batch['status']}: {answered} answers to {args.output}"
            + (
                f", {failed} failures to {args.output.with_suffix('.errors.jsonl')}"
                if failed
                else ""
            ),
            file=sys.stderr,
        )
        return 0 if batch["status"] == "completed" else 1
    except BatchCliError as err:
        print(f"kvmesh batch: {err}", file=sys.stderr)
        return 2
    finally:
        if stack is not None:
            os.killpg(stack.pid, signal.SIGINT)
            stack.wait(60)
