"""The OpenAI formats' adapter: Chat Completions and Completions bodies checked and turned
into a ``Conversation`` (the answer is written back by ``openai_writer.py``).

Pure: JSON text in, a ``Conversation`` out, or ``ApiError`` naming the field. The HTTP and
gRPC handlers only move bytes (the gRPC API's messages mirror these bodies).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Literal

from pydantic import Field, WithJsonSchema

from services.router.errors import ApiError
from services.router.formats.wire import (
    FalseOnly,
    NonEmpty,
    ServiceTier,
    Unserved,
    integer,
    parse_body,
    refuse_unserved,
    sampling_of,
    unserved,
)
from services.router.formats.wire import StrictBody as _Body
from services.router.request import conversation as conv
from shared.messages.sampling import MAX_REPETITION, MAX_TOP_LOGPROBS, SamplingParams


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageUrl(_Body):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] = "auto"


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageUrl


class FunctionCall(_Body):
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class ToolCallIn(_Body):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: FunctionCall


Content = str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]


class _ChatMessage(_Body):
    role: str  # each kind's own
    content: Content | None = None

    def message(self, i: int) -> conv.Message:
        """As the conversation's message (``i``: its place, for errors' names)."""
        where = f"messages[{i}]"
        parts: list[conv.Part] = []
        if isinstance(self.content, str):
            parts.append(conv.Text(self.content))
        for j, p in enumerate(self.content if isinstance(self.content, list) else ()):
            if isinstance(p, TextPart):
                parts.append(conv.Text(p.text))
            else:
                parts.append(conv.Image(p.image_url.url, f"{where}.content[{j}].image_url"))
        role = "system" if self.role == "developer" else self.role
        return conv.Message(role, tuple(parts), where, isinstance(self.content, list))


class SystemMessage(_ChatMessage):
    role: Literal["system", "developer"]


class UserMessage(_ChatMessage):
    role: Literal["user"]


class AssistantMessage(_ChatMessage):
    role: Literal["assistant"]
    tool_calls: list[ToolCallIn] | None = None

    def message(self, i: int) -> conv.Message:
        said = super().message(i)
        if not self.tool_calls:
            return said
        calls = []
        for j, c in enumerate(self.tool_calls):
            param = f"{said.param}.tool_calls[{j}].function.arguments"
            args = conv.arguments_object(c.function.arguments, param)
            calls.append(conv.ToolCall(c.id, c.function.name, args))
        return replace(said, parts=(*said.parts, *calls))


class ToolMessage(_ChatMessage):
    role: Literal["tool"]
    tool_call_id: str = Field(min_length=1, max_length=256)

    def message(self, i: int) -> conv.Message:
        where = f"messages[{i}]"
        text = (
            self.content
            if isinstance(self.content, str)
            else "".join(p.text for p in self.content or () if isinstance(p, TextPart))
        )
        result = conv.ToolResult(self.tool_call_id, text, f"{where}.tool_call_id")
        return conv.Message("tool", (result,), where, isinstance(self.content, list))


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str = Field(min_length=1)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: FalseOnly = False  # (streams are not obfuscated here)
    continuous_usage_stats: bool = Field(
        default=False, description="vLLM's: the usage so far on every chunk"
    )


class JsonSchema(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: dict = Field(default_factory=dict, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextFormat(_Body):
    type: Literal["text"]

    def answer(self) -> conv.JsonAnswer | None:
        return None


class JsonObjectFormat(_Body):
    type: Literal["json_object"]

    def answer(self) -> conv.JsonAnswer | None:
        return conv.JsonAnswer(None, "response_format")


class JsonSchemaFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchema

    def answer(self) -> conv.JsonAnswer | None:
        return conv.JsonAnswer(self.json_schema.schema_, "response_format.json_schema.schema")


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]
MAX_LOGIT_BIAS = 300
MAX_N = 128  # (the router's max_choices and a key's own limit are checked when prepared)
MAX_PROMPTS = 1024  # (and the router's max_prompts)
TOKEN_ID = r"^[0-9]{1,9}$"
# Token id → bias. Its schema by hand: pydantic states the keys' pattern as patternProperties,
# which lets any other key through.
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=TOKEN_ID)], Annotated[float, Field(ge=-100, le=100)]],
    Field(max_length=MAX_LOGIT_BIAS),
    WithJsonSchema(
        {
            "type": "object",
            "description": "token id → bias",
            "maxProperties": MAX_LOGIT_BIAS,
            "propertyNames": {"pattern": TOKEN_ID},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        }
    ),
]


class _Sampling(_Body):
    model: str = Field(min_length=1)
    service_tier: ServiceTier | None = Field(
        default=None, description="the request's class (auto: its key's default)"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: integer(ge=1) | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: integer(ge=0) | None = Field(
        default=None, description="kvmesh (as vLLM): 0 for no limit"
    )
    seed: integer() | None = None
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=4)] | None = None
    n: integer(ge=1, le=MAX_N) = Field(
        default=1, description="answers to the prompt (at most the key's or router's max_choices)"
    )
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: LogitBias | None = None
    user: str | None = Field(default=None, max_length=256)
    # vLLM's and SGLang's sampling extensions, named as vLLM names them.
    min_p: float | None = Field(default=None, ge=0, le=1, description="vLLM's: 0 for none")
    repetition_penalty: float | None = Field(
        default=None, gt=0, le=MAX_REPETITION, description="vLLM's: 1 for none"
    )
    ignore_eos: bool = Field(default=False, description="vLLM's: go on past end-of-answer")
    min_tokens: integer(ge=0) | None = Field(
        default=None, description="vLLM's: no end before this many answer tokens"
    )
    stop_token_ids: Annotated[list[integer(ge=0)], Field(max_length=64)] | None = Field(
        default=None, description="vLLM's: token ids that end the answer"
    )
    prompt_logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) | None = Field(
        default=None,
        description="vLLM's: each prompt token's log-probability, with this many of the "
        "likeliest (the prompt is computed whole: a cached block has no logits)",
    )

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    response_format: ResponseFormat | None = None
    modalities: list[Literal["text"]] | None = None
    store: FalseOnly | None = Field(default=None, description="stateless: nothing is stored")
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    # Accepted: kvmesh already routes each prompt by its own blocks' hashes, which is what
    # the key stands in for; every retention asked for is met (blocks stay days on storage).
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = Field(default=None, max_length=256)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # a forced choice makes one call; auto, any
    functions: Unserved = unserved("deprecated by OpenAI: use tools")
    function_call: Unserved = unserved("deprecated by OpenAI: use tool_choice")
    audio: Unserved = unserved("audio output is not served (the models answer in text)")
    prediction: Unserved = unserved("predicted outputs are not served")
    web_search_options: Unserved = unserved("web search is not served")
    reasoning_effort: Unserved = unserved("the models served do not reason before answering")
    verbosity: Unserved = unserved("the models served do not take a verbosity")


TokenIds = Annotated[list[integer(ge=0)], Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: (
        NonEmpty
        | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(description="a prompt, or several (each answered as a request of its own)")
    max_tokens: integer(ge=0) | None = Field(
        default=None, description="0 (with echo): the prompt scored, no answer"
    )
    logprobs: integer(ge=0, le=5) | None = None
    echo: bool = Field(
        default=False, description="the prompt before the answer (with logprobs: scored)"
    )
    best_of: integer(ge=1, le=MAX_N) | None = Field(
        default=None,
        description="candidates per prompt, the n likeliest returned (not with stream)",
    )
    suffix: Unserved = unserved("insertion (a suffix) is not served")


def conversation(body: bytes, chat: bool) -> conv.Conversation:
    """A Chat Completions (``chat``) or Completions body as the conversation it carries."""
    req = parse_body(body, ChatRequest if chat else CompletionRequest)
    assert isinstance(req, _Sampling)
    options = req.stream_options or StreamOptions()
    common = {
        "stream": req.stream,
        "include_usage": options.include_usage,
        "usage_every_chunk": options.continuous_usage_stats,
        "n": req.n,
        "prompt_scores": req.prompt_logprobs is not None,
        "service_tier": None if req.service_tier == "auto" else req.service_tier,
    }
    if isinstance(req, ChatRequest):
        return _chat(req, common)
    assert isinstance(req, CompletionRequest)
    refuse_unserved(req)
    best_of = req.best_of or req.n
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens: 0 only with echo (the prompt scored)", param="max_tokens")
    if best_of < req.n:
        raise ApiError(400, f"best_of: at least n ({req.n})", param="best_of")
    if best_of > req.n and req.stream:
        raise ApiError(400, "best_of: more than n cannot stream", param="best_of")
    prompts = _prompts(req.prompt)
    scored = req.logprobs if req.echo else None  # (echo with logprobs: the prompt's too)
    return conv.Conversation(
        req.model,
        prompt=prompts[0],
        sampling=_sampling(req, req.logprobs, scored),
        max_tokens=req.max_tokens,
        best_of=best_of,
        batch=prompts if len(prompts) > 1 else (),
        echo=req.echo,
        **common,
    )


def _prompts(prompt: str | list) -> tuple[str | tuple[int, ...], ...]:
    """A Completions prompt as the prompts it holds: text or token ids, each."""
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt[0], int):
        return (tuple(prompt),)
    return tuple(p if isinstance(p, str) else tuple(p) for p in prompt)


def _chat(req: ChatRequest, common: dict) -> conv.Conversation:
    refuse_unserved(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    limit, field = req.max_tokens, "max_tokens"
    if req.max_completion_tokens:
        limit, field = req.max_completion_tokens, "max_completion_tokens"
    tools = tuple(
        conv.Tool(
            t.function.name,
            t.function.description or "",
            t.function.parameters if t.function.parameters is not None else conv.NO_PARAMETERS,
            f"tools[{i}].function.parameters",
        )
        for i, t in enumerate(req.tools or ())
    )
    choice = req.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return conv.Conversation(
        req.model,
        tuple(m.message(i) for i, m in enumerate(req.messages)),
        sampling=_sampling(req, (req.top_logprobs or 0) if req.logprobs else None),
        max_tokens=limit,
        max_tokens_field=field,
        json=req.response_format.answer() if req.response_format is not None else None,
        tools=tools,
        tool_choice=conv.ToolChoice.of(choice if isinstance(choice, str) else None, named),
        best_of=req.n,
        **common,
    )


def _sampling(req: _Sampling, logprobs: int | None, scored: int | None = None) -> SamplingParams:
    """The body's sampling; ``scored``: the prompt's log-probabilities echo asks for."""
    wanted = [n for n in (req.prompt_logprobs, scored) if n is not None]
    return sampling_of(
        req,
        stop=tuple(req.stop_list()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        logit_bias=tuple((int(k), v) for k, v in (req.logit_bias or {}).items()),
        logprobs=logprobs,
        prompt_logprobs=max(wanted) if wanted else None,
    )
