"""How a model writes tool calls: the syntax its own chat template uses, read from the template.

A template that renders ``tools`` itself is used as it is (the model was trained on exactly
that prompt), and its answer's calls are parsed in the form the template writes calls back:

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` per call
  (Qwen2.5, Qwen3, Hermes; results in ``<tool_response>`` tags);
- ``llama3``: the answer is one JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1
  and later with custom tools; results in an ``ipython`` turn), several joined by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``
  (results in ``[TOOL_RESULTS]``; every call id is 9 letters or digits).

A template with no tool syntax (SmolLM2's ChatML) gets kvmesh's own: the Hermes form,
described in the system prompt by the renderer (``native`` False).
"""

from __future__ import annotations

import hashlib
import string
from dataclasses import dataclass

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
MISTRAL_MARK = "[TOOL_CALLS]"  # what starts Mistral's calls (a special token in its tokenizers)


@dataclass(frozen=True)
class ToolSyntax:
    kind: str  # HERMES, LLAMA3 or MISTRAL
    native: bool  # the model's template renders tools, calls and results itself

    @property
    def arguments_key(self) -> str:
        """The key a call's arguments are under."""
        return "parameters" if self.kind == LLAMA3 else "arguments"


FALLBACK = ToolSyntax(HERMES, native=False)


def tool_syntax(template: str) -> ToolSyntax:
    """The syntax of the template's source: its own when it renders ``tools`` in a form
    this module knows, else the Hermes fallback."""
    if "tools" not in template:
        return FALLBACK
    if "<tool_call>" in template:
        return ToolSyntax(HERMES, native=True)
    if MISTRAL_MARK in template:
        return ToolSyntax(MISTRAL, native=True)
    if "ipython" in template and '"parameters"' in template:
        return ToolSyntax(LLAMA3, native=True)
    return FALLBACK  # tools in a form kvmesh does not parse: its own, described in the prompt


_ALNUM = string.ascii_letters + string.digits


def short_call_id(call_id: str) -> str:
    """A call id as Mistral's templates require it (9 letters or digits), the same for the
    same id, so a call and its result still pair up."""
    digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    out = []
    for _ in range(9):
        digest, k = divmod(digest, len(_ALNUM))
        out.append(_ALNUM[k])
    return "".join(out)
