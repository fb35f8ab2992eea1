"""What a model's chat template is given: a conversation's messages, with its tools, their
calls and their results in the form the template takes.

A template that renders tools itself gets them, and the calls and results, as Hugging Face
passes them (``template_messages``), and the model writes calls in its own form
(shared/model/tools.py). One whose template has no tool syntax gets kvmesh's: a
Hermes-style preamble at the end of the system prompt, each call as <tool_call> JSON, results
as <tool_response> in a user turn (``chat_messages``). Either is one form whichever API
carried the conversation, so a tool-heavy conversation keeps its cache hits across formats.
"""

from __future__ import annotations

import json

from services.router.request.conversation import (
    Conversation,
    Image,
    Part,
    Text,
    Tool,
    ToolCall,
    ToolResult,
)
from shared.model.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from shared.model.tools import FALLBACK, HERMES, ToolSyntax, short_call_id

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def tool_spec(tool: Tool) -> dict:
    spec: dict = {"name": tool.name}
    if tool.description:
        spec["description"] = tool.description
    spec["parameters"] = tool.parameters
    return {"type": "function", "function": spec}


def call_text(call: ToolCall, syntax: ToolSyntax = FALLBACK) -> str:
    """A call as the model writes it (and as the grammar forces it)."""
    body = {"name": call.name, syntax.arguments_key: call.arguments}
    text = json.dumps(body, ensure_ascii=False)
    return (
        text
        if syntax.native and syntax.kind != HERMES
        else f"{TOOL_CALL_OPEN}{text}{TOOL_CALL_CLOSE}"
    )


def result_text(result: ToolResult, syntax: ToolSyntax = FALLBACK) -> str:
    if syntax.native:  # the template wraps it
        return result.content
    return f"<tool_response>\n{result.content}\n</tool_response>"


def part_text(part: Text | ToolCall | ToolResult, syntax: ToolSyntax = FALLBACK) -> str:
    """A text part's text; a tool call or result as the prompt renders it."""
    if isinstance(part, ToolCall):
        return call_text(part, syntax)
    if isinstance(part, ToolResult):
        return result_text(part, syntax)
    return part.text


def template_messages(conv: Conversation, marker: str) -> list[dict]:
    """The messages as Hugging Face gives them to a template that renders tools: an
    assistant's calls in ``tool_calls`` (arguments as objects), each result a ``tool``
    message with its call's id; image k (in order) as ``{marker}{k}\\0``. Ids are 9 letters or
    digits made from the client's (as Mistral's templates require; the others ignore them)."""
    out: list[dict] = []
    k = 0
    for m in conv.messages:
        if m.role == "tool":
            out += [
                {"role": "tool", "tool_call_id": short_call_id(p.call_id), "content": p.content}
                for p in m.parts
                if isinstance(p, ToolResult)
            ]
            continue
        content, calls, k = _text_and_calls(m.parts, marker, k)
        message: dict = {"role": m.role, "content": content}
        if calls:
            message["tool_calls"] = [
                {
                    "id": short_call_id(c.id),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
        out.append(message)
    return out


def chat_messages(conv: Conversation, marker: str) -> list[dict[str, str]]:
    """The messages for the chat template; image k (in order) as ``{marker}{k}\\0``; tool
    results as user turns (consecutive ones in one), tools described in the system prompt."""
    out: list[dict[str, str]] = []
    k = 0
    last_was_tool = False
    for m in conv.messages:
        if m.role == "tool":
            text = "\n".join(result_text(p) for p in m.parts if isinstance(p, ToolResult))
            if last_was_tool:
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
            last_was_tool = True
            continue
        last_was_tool = False
        content, calls, k = _text_and_calls(m.parts, marker, k)
        if calls:
            sep = "" if not content or content.endswith("\n") else "\n"
            content += sep + "\n".join(call_text(c) for c in calls)
        out.append({"role": m.role, "content": content})
    if conv.tools:
        specs = (json.dumps(tool_spec(t), ensure_ascii=False) for t in conv.tools)
        preamble = TOOLS_PREAMBLE.format(tools="\n".join(specs))
        if out and out[0]["role"] == "system":
            out[0]["content"] += "\n\n" + preamble
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def _text_and_calls(
    parts: tuple[Part, ...], marker: str, k: int
) -> tuple[str, list[ToolCall], int]:
    """A message's text (image k as ``{marker}{k}\\0``), its calls, and the next image's k."""
    text, calls = [], []
    for part in parts:
        if isinstance(part, Text):
            text.append(part.text)
        elif isinstance(part, Image):
            text.append(f"{marker}{k}\x00")
            k += 1
        elif isinstance(part, ToolCall):
            calls.append(part)
    return "".join(text), calls, k
