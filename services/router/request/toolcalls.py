"""Tool calls in an answer, in the syntax of the model's template (shared/model/tools.py):
this splits the streamed text into the answer's text and its calls.

The Hermes form (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``: Qwen's
templates, and the form the renderer teaches a model whose template has none) is parsed by
``CallParser``; the forms where the calls are the answer itself (Llama 3's JSON object,
Mistral's ``[TOOL_CALLS]`` list) by ``LeadingCallsParser``.

A forced call (``tool_choice`` required or named: the grammar guarantees its form) streams as
it comes: its start (id and name) once the name is complete, then the arguments in pieces as
the model writes them. A call the model chose to write on its own is held until it is
complete and checked: a valid one is sent whole, anything else stays text. Whitespace
between and after calls is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Protocol

from shared.model.tools import LLAMA3, MISTRAL, MISTRAL_MARK, ToolSyntax

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
# The start of a call as the grammar writes it, up to its arguments' opening brace.
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


@dataclass
class CallEvent:
    """A piece of a tool call: its start (``name`` set, with its ``id``), a piece of its
    arguments' JSON text, or its end (``done``)."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""
    done: bool = False


@dataclass
class Call:
    id: str
    name: str
    arguments: str  # JSON text of an object, as the model wrote it


def calls_of(events: list[CallEvent]) -> list[Call]:
    """The complete calls an answer's events make, in order."""
    calls: dict[int, Call] = {}
    for e in events:
        if e.name:
            calls[e.index] = Call(e.id, e.name, "")
        calls[e.index].arguments += e.arguments
    return list(calls.values())


class Parser(Protocol):
    calls: int

    def feed(self, text: str) -> tuple[str, list[CallEvent]]: ...
    def finish(self) -> tuple[str, list[CallEvent]]: ...


def call_parser(syntax: ToolSyntax, streamed: bool) -> Parser:
    """The parser for answers written in ``syntax``; ``streamed``: the calls are forced."""
    if syntax.kind in (LLAMA3, MISTRAL):
        return LeadingCallsParser(syntax)
    return CallParser(streamed)


class CallParser:
    def __init__(self, streamed: bool) -> None:
        """``streamed``: calls are forced by the grammar, so each streams as it comes."""
        self.streamed = streamed
        self._buf = ""
        self._inside = False
        self._count = 0
        self._started = False  # the current call's start was sent
        self._args_at = -1  # where its arguments begin in the buffer
        self._sent_to = 0  # how much of its arguments was sent
        self._depth = 0  # the arguments' JSON nesting, scanned up to _scanned
        self._scanned = 0
        self._in_string = self._escaped = False
        self._args_end = -1  # where its arguments end (the closing brace + 1)

    @property
    def calls(self) -> int:
        return self._count

    def feed(self, text: str) -> tuple[str, list[CallEvent]]:
        """New answer text in: the text and the call events it makes."""
        self._buf += text
        out_text, events = "", []
        while True:
            if not self._inside:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    out_text += self._text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out_text, events
                out_text += self._text(self._buf[:at])
                self._buf = self._buf[at + len(OPEN) :]
                self._inside = True
                self._reset_call()
                continue
            end = self._buf.find(CLOSE)
            if end < 0:
                if self.streamed:
                    events += self._stream_call()
                return out_text, events
            body, self._buf = self._buf[:end], self._buf[end + len(CLOSE) :]
            self._inside = False
            call = _parse(body)
            if call is None:  # not a call after all: its text, as written
                if self._started:  # (a forced call cut short cannot get here: it is valid)
                    events.append(CallEvent(self._count - 1, done=True))
                else:
                    out_text += self._text(OPEN + body + CLOSE)
                continue
            events += self._finish_call(body, call)

    def finish(self) -> tuple[str, list[CallEvent]]:
        """The end of the answer: whatever is held back."""
        rest, self._buf = self._buf, ""
        if not self._inside:
            return self._text(rest), []
        self._inside = False
        if self._started:  # a streamed call the answer's length cut short
            events = self._stream_call_text(rest, final=True)
            return "", [*events, CallEvent(self._count - 1, done=True)]
        return self._text(OPEN + rest), []

    # -- inside a call --------------------------------------------------------------------

    def _reset_call(self) -> None:
        self._started = False
        self._args_at = -1
        self._sent_to = self._depth = self._scanned = 0
        self._in_string = self._escaped = False
        self._args_end = -1

    def _start(self, name: str) -> CallEvent:
        self._started = True
        self._count += 1
        return CallEvent(self._count - 1, id=uuid.uuid4().hex[:24], name=name)

    def _stream_call(self) -> list[CallEvent]:
        return self._stream_call_text(self._buf, final=False)

    def _stream_call_text(self, body: str, final: bool) -> list[CallEvent]:
        events = []
        if not self._started:
            m = _NAME.match(body)
            if m is None:
                return []
            events.append(self._start(json.loads(f'"{m.group(1)}"')))
            self._args_at = self._scanned = m.end()
        self._scan(body)
        upto = len(body) if self._args_end < 0 else self._args_end
        if upto > self._args_at + self._sent_to:
            piece = body[self._args_at + self._sent_to : upto]
            self._sent_to += len(piece)
            events.append(CallEvent(self._count - 1, arguments=piece))
        return events

    def _scan(self, body: str) -> None:
        """Follow the arguments' JSON to find where the object ends."""
        for i in range(self._scanned, len(body)):
            if self._args_end >= 0:
                break
            c = body[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._args_end = i + 1
        self._scanned = len(body)

    def _finish_call(self, body: str, call: tuple[str, str]) -> list[CallEvent]:
        name, arguments = call
        if not self._started:  # held until now (not streamed, or its form was unusual)
            start = self._start(name)
            return [
                start,
                CallEvent(start.index, arguments=arguments),
                CallEvent(start.index, done=True),
            ]
        events = self._stream_call_text(body, final=True)
        return [*events, CallEvent(self._count - 1, done=True)]

    def _text(self, text: str) -> str:
        """Text outside calls; blank text once a call was made is dropped."""
        return "" if self._count and not text.strip() else text


def _parse(body: str) -> tuple[str, str] | None:
    """A call's name and its arguments' JSON text (as written), or None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    m = _NAME.match(body)
    if m is not None:  # the arguments as the model wrote them
        decoder = json.JSONDecoder()
        try:
            _, end = decoder.raw_decode(body, m.end())
            return obj["name"], body[m.end() : end]
        except ValueError:
            pass
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could begin ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class LeadingCallsParser:
    """Calls that are the answer itself: Llama 3's ``{"name": ..., "parameters": {...}}``
    (several joined by ``;``) or Mistral's ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``
    (the marker is a special token, so it may not be in the text). Whether the answer is calls
    is decided by its first character; calls are sent whole as each one completes, anything
    that does not parse as calls is text, as written."""

    def __init__(self, syntax: ToolSyntax) -> None:
        self.kind = syntax.kind
        self._opens = "[" if syntax.kind == MISTRAL else "{"
        self._buf = ""
        self._mode = ""  # "" until decided, then "text" or "calls"
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[CallEvent]]:
        self._buf += text
        if not self._mode:
            head = self._head()
            if head is None:
                return "", []  # nothing but blanks (or part of the marker) yet
            self._mode = "calls" if head.startswith(self._opens) else "text"
        if self._mode == "text":
            out, self._buf = self._buf, ""
            return ("" if self.calls and not out.strip() else out), []
        events = self._take()
        if self._mode == "text":  # what follows the calls
            return self.feed("")[0], events
        return "", events

    def finish(self) -> tuple[str, list[CallEvent]]:
        events = self._take() if self._mode == "calls" else []
        rest, self._buf = self._buf, ""
        if self.calls and not rest.strip(" \n;"):
            rest = ""
        return rest, events

    def _head(self) -> str | None:
        """The answer's text from its first non-blank character, past Mistral's marker;
        None while it could still be only blanks or part of the marker."""
        head = self._buf.lstrip()
        if self.kind == MISTRAL:
            if MISTRAL_MARK.startswith(head):
                return None
            head = head.removeprefix(MISTRAL_MARK).lstrip()
        return head or None

    def _take(self) -> list[CallEvent]:
        """Every complete call at the buffer's start, as events; a value that is complete
        but not calls turns the rest of the answer into text."""
        events: list[CallEvent] = []
        decoder = json.JSONDecoder()
        while True:
            head = self._head() if self.calls == 0 else self._buf.lstrip(" \n;")
            if not head or not head.startswith(self._opens):
                if head and self.calls:
                    self._mode = "text"  # text after the calls
                return events
            try:
                value, end = decoder.raw_decode(head)
            except ValueError:
                return events  # not complete yet (or not JSON: text at the finish)
            calls = [_leading_call(v) for v in (value if isinstance(value, list) else [value])]
            if not calls or None in calls:
                self._mode = "text"
                return events
            for name, arguments in calls:
                start = CallEvent(self.calls, id=uuid.uuid4().hex[:24], name=name)
                events += [start, CallEvent(self.calls, arguments=arguments)]
                events.append(CallEvent(self.calls, done=True))
                self.calls += 1
            self._buf = head[end:]
            if self.kind == MISTRAL:  # one list holds all of them
                self._mode = "text"
                return events


def _leading_call(value: object) -> tuple[str, str] | None:
    """A call object's name and arguments (as JSON text), or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("parameters", value.get("arguments", {}))
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)
