"""A batch's input: its lines checked before any runs, and the order they run in so that lines
sharing a prompt prefix reuse it."""

from __future__ import annotations

import asyncio
import collections
import json

from pydantic import BaseModel

from services.router.batch.store import LineError


class Line(BaseModel):
    index: int
    custom_id: str
    body: dict
    body_bytes: bytes  # the body as a request would carry it


def parse_input(data: bytes, endpoint: str, max_lines: int) -> tuple[list[Line], list[LineError]]:
    """Every line checked (JSON, the fields, a custom_id once, the batch's endpoint, no
    streaming) before any runs; the errors name their line (1-based)."""
    lines: list[Line] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    raw_lines = [r for r in data.decode("utf-8", errors="replace").splitlines()]
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue

        def bad(code: str, message: str, param: str | None = None, n: int = number) -> None:
            errors.append(LineError(code=code, message=message, param=param, line=n))

        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as err:
            bad("invalid_json_line", f"line {number} is not JSON: {err.msg}")
            continue
        if not isinstance(obj, dict):
            bad("invalid_request", f"line {number}: a JSON object expected")
            continue
        custom_id, method, url, body = (obj.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
            bad("missing_custom_id", "custom_id: a string of 1 to 512 characters", "custom_id")
            continue
        if custom_id in seen:
            bad("duplicate_custom_id", f"custom_id {custom_id!r} appears twice", "custom_id")
            continue
        seen.add(custom_id)
        if method != "POST":
            bad("invalid_method", f"method: POST (got {method!r})", "method")
            continue
        if url != endpoint:
            bad("mismatched_url", f"url: the batch's endpoint {endpoint} (got {url!r})", "url")
            continue
        if not isinstance(body, dict):
            bad("invalid_request", "body: a JSON object", "body")
            continue
        if body.get("stream"):
            bad("invalid_request", "body.stream: a batch line cannot stream", "body.stream")
            continue
        lines.append(Line(index=len(lines), custom_id=custom_id, body=body, body_bytes=b""))
    if not lines and not errors:
        errors.append(LineError(code="empty_file", message="the input file has no request"))
    if len(lines) > max_lines:
        errors.append(
            LineError(
                code="too_many_requests",
                message=f"a batch holds at most {max_lines} requests (got {len(lines)})",
            )
        )
    for line in lines:
        line.body_bytes = json.dumps(line.body).encode()
    return lines, errors


def prefix_key(line: Line) -> tuple[str, str]:
    """What a line's prompt starts with (its model, then the text of its system prompt and
    messages, or its raw prompt, from the start): lines with the same key share a prefix."""
    body = line.body
    text = json.dumps(body.get("system", ""), sort_keys=True)
    for message in body.get("messages") or []:
        if len(text) > PREFIX_CHARS:
            break
        text += json.dumps(message, sort_keys=True)
    if "prompt" in body:
        text += json.dumps(body["prompt"])
    return str(body.get("model", "")), text[:PREFIX_CHARS]


PREFIX_CHARS = 4096


class Schedule:
    """A batch's lines in the order that reuses prefixes: the first line of each group that
    shares a prefix (its leader) goes alone; the rest of the group once the leader is answered
    (its prefix is in the tiers by then), ahead of other groups' leaders, so a group runs
    while its prefix is still in memory. Lines that share nothing are each a group of one."""

    def __init__(self, lines: list[Line]) -> None:
        groups: dict[tuple[str, str], list[Line]] = {}
        for line in lines:
            groups.setdefault(prefix_key(line), []).append(line)
        self.ready = collections.deque(group[0] for group in groups.values())
        self.followers = {group[0].index: group[1:] for group in groups.values() if group[1:]}
        self.running = 0
        self.changed = asyncio.Event()

    async def take(self) -> Line | None:
        """The next line to run; None when none is left."""
        while True:
            if self.ready:
                self.running += 1
                return self.ready.popleft()
            if not self.followers:
                return None
            self.changed.clear()
            await self.changed.wait()

    def done(self, line: Line) -> None:
        """A line ended (answered or not): its group's other lines may go."""
        self.running -= 1
        self.ready.extendleft(reversed(self.followers.pop(line.index, [])))
        if not self.running and not self.ready:
            self.followers.clear()  # (leaders that never ran: the batch stopped)
        self.changed.set()
