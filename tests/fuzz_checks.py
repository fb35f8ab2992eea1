"""Schemathesis checks of kvmesh's own, loaded by the fuzzer (``SCHEMATHESIS_HOOKS``):
tests/test_fuzz.py and bench/fuzz.py.

Schemathesis's ``positive_data_acceptance`` says a request /openapi.json allows must not get a
400. kvmesh's schemas say everything a body's shape can say, so a 400 for a request they allow
must come from a rule no schema can state: one that depends on the model (its context, its
vocabulary), on what a string holds (a call's arguments as JSON text, a JSON schema that
cannot be used, an image's bytes), or on two fields together. ``refusals_name_a_rule`` holds
every such 400 to that list; any other is the schema falling behind the server.
"""

from __future__ import annotations

import re

import schemathesis

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
