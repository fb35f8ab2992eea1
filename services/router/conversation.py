"""One conversation, whichever API it came in: what the renderer turns into tokens.

Each API format has an adapter that checks its request body and builds a ``Conversation``
(``openai_api.py`` for Chat Completions and Completions); everything after that (images,
rendering, limits, dispatch) reads only this, so a conversation renders to the same tokens
whatever format carried it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Image:
    url: str  # a data: URL, or http(s) when remote images are allowed
    param: str  # where it was in the request, for errors ("messages[1].content[0].image_url")


Part = Text | Image


@dataclass(frozen=True)
class Message:
    role: str  # system, user or assistant
    parts: tuple[Part, ...]
    param: str = ""  # where it was in the request ("messages[2]", "system"), for explanations
    listed: bool = False  # its content came as a list of parts (else one string)


@dataclass(frozen=True)
class JsonAnswer:
    """The answer must be JSON: any object (``schema`` None) or a value of ``schema``."""

    schema: dict | None
    param: str  # the field that asked, named in errors ("response_format", "text.format")


@dataclass(frozen=True)
class Asked:
    """The sampling a request asked for, before the server's defaults and limits."""

    max_tokens: int | None = None
    max_field: str = "max_tokens"  # the field that set it, named in errors
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias): checked by the frontend
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; else the chosen token's and this many top ones
    json: JsonAnswer | None = None  # constrained to JSON (response_format, text.format)


@dataclass(frozen=True)
class Conversation:
    """Messages for the model's chat template, or a raw prompt (text or token ids)."""

    model: str
    asked: Asked
    messages: tuple[Message, ...] = ()
    prompt: str | tuple[int, ...] | None = None
    stream: bool = False
    include_usage: bool = False

    @property
    def chat(self) -> bool:
        return self.prompt is None

    @property
    def prompt_field(self) -> str:
        return "messages" if self.chat else "prompt"

    def images(self) -> list[tuple[str, Image]]:
        """Every image with the role of its message, in order."""
        return [(m.role, p) for m in self.messages for p in m.parts if isinstance(p, Image)]
