"""The fuzzers of tests/test_fuzz.py and bench/fuzz.py: Schemathesis's command line run on a
router's /openapi.json (``schemathesis_run``), with a check of kvmesh's own that this module
registers (the run loads it through ``SCHEMATHESIS_HOOKS``); and Hypothesis strategies for the
gRPC API's messages, from their protobuf descriptors through JSON Schema (``grpc_requests``).

Schemathesis's ``positive_data_acceptance`` says a request /openapi.json allows must not get a
400. kvmesh's schemas say everything a body's shape can say, so a 400 for a request they allow
must come from a rule no schema can state: one that depends on the model (its context, its
vocabulary), on what a string holds (a call's arguments as JSON text, a JSON schema that
cannot be used, an image's bytes), or on two fields together. ``refusals_name_a_rule`` holds
every such 400 to that list; any other is the schema falling behind the server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import schemathesis
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

RULES = re.compile(
    "|".join(
        [
            r"exceeds the model's context",  # the prompt and the answer's room, per model
            r"is outside the vocabulary",  # a token id, per model
            r": not JSON$|: a JSON object is required$",  # a call's arguments (JSON text)
            r"no tool is named|needs tools|a second tool named",  # tool_choice against tools
            r"no earlier tool call has the id",  # a tool result answers a call before it
            r"this schema cannot be used",  # response_format's JSON schema
            r"chat template refused them",  # the model's template (roles out of order)
            r"needs logprobs: true",  # top_logprobs without logprobs
            r"the prompt is empty",  # messages whose content renders to nothing
            r"image",  # an image part's bytes or address
            r"the data: URL's base64 is not valid",  # (an image's, in Anthropic's source)
            r"completion_window: 24h, or a shorter time",  # within 24 h (the pattern: a time)
            r"at most \d+ answers per prompt",  # n, best_of: the key's or the router's limit
            r"at most \d+ prompts in one request",  # a batch of prompts: the router's limit
            r"min_tokens: at most",  # the least answer length within the most (max_tokens)
            r"only with echo|best_of: at least n|more than n cannot stream",  # two fields
            r"do not fit one message",  # a prompt's scores, by its length (tokens, not bytes)
            # a LoRA adapter: what its path holds, its name and base against the mesh's models
            r"adapter directory|adapter_config\.json|adapter_model|not a directory path",
            r"is not a model of this mesh|is a base model's name|set in the settings",
        ]
    )
)


def _message(body: object) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))
    return ""


@schemathesis.check
def refusals_name_a_rule(ctx, response, case) -> bool | None:  # noqa: ANN001
    """A 400 for a request the schema allows names a rule no schema can state."""
    mode = case.meta.generation.mode if case.meta is not None else None
    if response.status_code != 400 or mode is None or not mode.is_positive:
        return None
    try:
        message = _message(response.json())
    except ValueError:
        message = ""
    if not RULES.search(message):
        raise AssertionError(f"a request /openapi.json allows was refused: {message!r}")
    return True


# -- the HTTP API: Schemathesis's command line -------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


@dataclass
class FuzzRun:
    returncode: int
    cases: int  # requests generated and sent
    operations: int  # operations tested
    failures: int  # unique failures found
    links: int  # OpenAPI links followed by the stateful phase (a call's answer into the next)
    output: str


def schemathesis_run(
    url: str, key: str, seed: int, max_examples: int, timeout_s: float, workers: int = 1
) -> FuzzRun:
    """Every operation of the router at ``url`` (127.0.0.1), every check Schemathesis has
    (``positive_data_acceptance`` replaced by ``refusals_name_a_rule``), its phases that
    apply (stateful: the document's links, an upload into a batch into its cancel), seeded:
    a failure reproduces with the same seed."""
    command = [
        str(Path(sys.executable).parent / "schemathesis"),
        "run",
        f"{url}/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",
        "--max-examples",
        str(max_examples),
        "--seed",
        str(seed),
        "--workers",
        str(workers),
        "--header",
        f"Authorization: Bearer {key}",
        "--request-timeout",
        "60",
        "--generation-database",
        "none",
        "--no-color",
        "--output-truncate",
        "false",
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.fuzzing", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO
    )
    out = done.stdout + done.stderr

    def figure(pattern: str) -> int:
        found = re.search(pattern, out)
        return int(found.group(1)) if found else 0

    return FuzzRun(
        done.returncode,
        figure(r"(\d+) generated"),
        figure(r"Tested: (\d+)"),
        figure(r"(\d+) unique failures?"),
        figure(r"API Links:\s+(\d+) covered"),
        out,
    )


# -- the gRPC API: Hypothesis from the messages' descriptors ----------------------------------

_SCALARS = {
    FieldDescriptor.TYPE_STRING: st.text(max_size=64),
    FieldDescriptor.TYPE_BYTES: st.one_of(
        st.binary(max_size=64), st.sampled_from([b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF"])
    ),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32),
    FieldDescriptor.TYPE_DOUBLE: st.floats(),
}


def messages(
    descriptor: Descriptor, likely: dict[str, st.SearchStrategy] | None = None
) -> st.SearchStrategy:
    """Protobuf messages of ``descriptor``: any field set or not, each by its type (repeated:
    up to 4), at most one member of a oneof, nested messages likewise. ``likely``: values
    also drawn for a field (a served model's name, a short answer), so that cases get past
    the first check. (hypothesis-jsonschema, the way through JSON Schema, no longer runs on
    the Hypothesis that Schemathesis needs.)"""
    likely = likely or {}
    cls = message_class(descriptor)
    value = field_values(descriptor, likely)
    plain = [f for f in descriptor.fields if f.containing_oneof is None or _synthetic(f)]
    choices = [o for o in descriptor.oneofs if not _synthetic(o.fields[0])]
    fields = st.fixed_dictionaries({}, optional={f.name: value[f.name] for f in plain})
    picks = st.tuples(
        *(
            st.one_of(st.none(), *(st.tuples(st.just(f.name), value[f.name]) for f in o.fields))
            for o in choices
        )
    )

    @st.composite
    def build(draw: st.DrawFn) -> object:
        kwargs = draw(fields)
        for pick in draw(picks):
            if pick is not None:
                kwargs[pick[0]] = pick[1]
        return cls(**kwargs)

    return build()


def ask_grpc(address: str, key: str, request: object) -> tuple[str, str]:
    """``request`` sent to the router's gRPC API at ``address`` (GenerateStream when its
    max_tokens is odd, else Generate): ("answered", "") or the refusal's code and details."""
    import grpc

    from shared.proto import api_pb2_grpc

    metadata = (("authorization", f"Bearer {key}"),)
    with grpc.insecure_channel(address) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        try:
            if request.max_tokens % 2:  # type: ignore[attr-defined]
                for _ in stub.GenerateStream(request, timeout=60, metadata=metadata):
                    pass
            else:
                stub.Generate(request, timeout=60, metadata=metadata)
        except grpc.RpcError as err:
            return err.code().name, err.details() or ""
    return "answered", ""


def field_values(
    descriptor: Descriptor, likely: dict[str, st.SearchStrategy]
) -> dict[str, st.SearchStrategy]:
    """Each field's values, by name, as ``messages`` draws them."""

    def value(f: FieldDescriptor) -> st.SearchStrategy:
        one = (
            st.deferred(lambda: messages(f.message_type, likely))
            if f.type == FieldDescriptor.TYPE_MESSAGE
            else _SCALARS[f.type]
        )
        if f.name in likely:
            one = st.one_of(likely[f.name], one)
        return st.lists(one, max_size=4) if f.is_repeated else one

    return {f.name: value(f) for f in descriptor.fields}


def mutants(base: object, likely: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """``base`` (a message that is answered) with one field drawn anew: each case is one
    step from an answer, so the checks behind the first are reached too."""
    descriptor = base.DESCRIPTOR  # type: ignore[attr-defined]
    values = field_values(descriptor, likely)

    @st.composite
    def mutate(draw: st.DrawFn) -> object:
        field = draw(st.sampled_from(list(descriptor.fields)))
        new = type(base)()
        new.CopyFrom(base)  # type: ignore[attr-defined]
        new.ClearField(field.name)
        value = draw(values[field.name])
        if field.is_repeated:
            getattr(new, field.name).extend(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(new, field.name).CopyFrom(value)
        else:
            setattr(new, field.name, value)
        return new

    return mutate()


def _synthetic(f: FieldDescriptor) -> bool:
    """proto3's ``optional`` (a oneof of one field, named ``_field``), not a real choice."""
    return f.containing_oneof is not None and f.containing_oneof.name == f"_{f.name}"


def message_class(descriptor: Descriptor) -> type:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)
