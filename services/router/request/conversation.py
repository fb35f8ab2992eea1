"""One conversation, whichever API it came in: what the renderer turns into tokens.

Each API format has an adapter that checks its request body and builds a ``Conversation``
(``formats/openai.py`` for Chat Completions and Completions, ...); everything after that
(images, rendering, limits, dispatch) reads only this, so a conversation renders to the same
tokens whatever format carried it. How to sample the answer travels as the engine takes it
(``SamplingParams``), from the adapter to the sampler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from services.router.errors import ApiError
from shared.messages.sampling import SamplingParams


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Image:
    url: str  # a data: URL, or http(s) when remote images are allowed
    param: str  # where it was in the request, for errors ("messages[1].content[0].image_url")


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant message made (its id is not rendered: the same call renders the
    same whichever API's ids it came with)."""

    id: str
    name: str
    arguments: dict  # the arguments object, parsed


@dataclass(frozen=True)
class ToolResult:
    """What a call returned, in a tool message."""

    call_id: str
    content: str
    param: str  # where it was in the request, for errors


Part = Text | Image | ToolCall | ToolResult


NO_PARAMETERS = {"type": "object", "properties": {}}  # a tool that declares none takes {}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of its arguments
    param: str  # where it was in the request ("tools[1]"), for errors


@dataclass(frozen=True)
class ToolChoice:
    """Whether the model may, must, or must not call a tool (or must call ``name``)."""

    kind: str = "auto"  # auto, none, required, named
    name: str = ""
    param: str = "tool_choice"

    @classmethod
    def of(cls, choice: str | None, named: str | None) -> ToolChoice:
        """OpenAI's tool_choice: "none", "auto", "required", or a function ``named``."""
        return cls("named", named) if named is not None else cls(choice or "auto")


@dataclass(frozen=True)
class Message:
    role: str  # system, user, assistant or tool
    parts: tuple[Part, ...]
    param: str = ""  # where it was in the request ("messages[2]", "system"), for explanations
    listed: bool = False  # its content came as a list of parts (else one string)


@dataclass(frozen=True)
class JsonAnswer:
    """The answer must be JSON: any object (``schema`` None) or a value of ``schema``."""

    schema: dict | None
    param: str  # the field that asked, named in errors ("response_format", "text.format")


@dataclass(frozen=True)
class Conversation:
    """Messages for the model's chat template, or a raw prompt (text or token ids), and how
    to answer them."""

    model: str
    messages: tuple[Message, ...] = ()
    prompt: str | tuple[int, ...] | None = None
    # How to sample the answer, as asked; its max_tokens is set when the request is prepared:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # the answer's length asked for (None: the router's default)
    max_tokens_field: str = "max_tokens"  # the field that asked for it, named in errors
    json: JsonAnswer | None = None  # the answer is constrained to JSON (response_format, ...)
    stream: bool = False
    include_usage: bool = False  # (OpenAI's stream_options.include_usage)
    usage_every_chunk: bool = False  # (and vLLM's continuous_usage_stats: the usage so far)
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    # Several answers (OpenAI's ``n``), chosen from ``best_of`` candidates by cumulative
    # log-probability; ``batch``: a Completions request's prompts when it sends several (each
    # answered as a request of its own, its answers in order: ``request/prepare.py``).
    n: int = 1
    best_of: int = 1
    batch: tuple[str | tuple[int, ...], ...] = ()
    echo: bool = False  # (Completions) the prompt before the answer; max_tokens 0: it alone
    prompt_scores: bool = False  # vLLM's prompt_logprobs asked for: shown in each choice
    service_tier: str | None = None  # the class asked for (None: the key's default)

    @property
    def scores_only(self) -> bool:
        """The prompt is scored (echoed with its log-probabilities), no answer made."""
        return self.max_tokens == 0

    def prompts(self) -> list[Conversation]:
        """The conversation once per prompt it carries (a batch's, in order)."""
        if not self.batch:
            return [self]
        return [replace(self, prompt=p, batch=()) for p in self.batch]

    @property
    def calls_tools(self) -> bool:
        """The answer may hold tool calls (to be parsed out of it)."""
        return bool(self.tools) and self.tool_choice.kind != "none"

    @property
    def forced_tools(self) -> tuple[Tool, ...]:
        """The tools one of which the answer must call (none: it need not)."""
        if self.tool_choice.kind == "required":
            return self.tools
        if self.tool_choice.kind == "named":
            return tuple(t for t in self.tools if t.name == self.tool_choice.name)
        return ()

    def check_tools(self) -> None:
        """Tool names unique, a named choice among them, every result for an earlier call:
        ValueError naming the field otherwise."""
        names = [t.name for t in self.tools]
        for t in self.tools:
            if names.count(t.name) > 1:
                raise ToolError(f"{t.param}: a second tool named {t.name!r}", t.param)
        choice = self.tool_choice
        if choice.kind in ("required", "named") and not self.tools:
            raise ToolError(f"{choice.param}: {choice.kind} needs tools", choice.param)
        if choice.kind == "named" and choice.name not in names:
            why = f"{choice.param}: no tool is named {choice.name!r} (tools: {', '.join(names)})"
            raise ToolError(why, choice.param)
        called: set[str] = set()
        for m in self.messages:
            for p in m.parts:
                if isinstance(p, ToolCall):
                    called.add(p.id)
                elif isinstance(p, ToolResult) and p.call_id not in called:
                    why = f"{p.param}: no earlier tool call has the id {p.call_id!r}"
                    raise ToolError(why, p.param)

    @property
    def chat(self) -> bool:
        return self.prompt is None

    @property
    def prompt_field(self) -> str:
        return "messages" if self.chat else "prompt"

    def where(self, message: int | None, part: int | None) -> str | None:
        """Where a part was in the request, in the request's own terms:
        ``messages[2].content[1]``, ``system``, ``input[0]``, ``prompt``."""
        if not self.chat:
            return "prompt"
        if message is None or part is None or message >= len(self.messages):
            return None
        m = self.messages[message]
        return f"{m.param}.content[{part}]" if m.listed else m.param or None

    def images(self) -> list[tuple[str, Image]]:
        """Every image with the role of its message, in order."""
        return [(m.role, p) for m in self.messages for p in m.parts if isinstance(p, Image)]


def arguments_object(text: str, param: str) -> dict:
    """A call's arguments sent as JSON text (OpenAI's formats), parsed: an object. Called
    while a body is read: a 400 naming the field when they are not."""
    try:
        obj = json.loads(text)
    except ValueError:
        raise ApiError(400, f"{param}: not JSON", param=param) from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"{param}: a JSON object is required", param=param)
    return obj


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
