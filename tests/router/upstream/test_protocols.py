"""How the router puts a request to a server it did not start, and reads the server's stream
(services/router/upstream/protocols.py): each body's fields against the pinned releases' own
request types (a field vLLM or SGLang would refuse, or one renamed upstream, fails here), and
chunks as the servers send them read into the answer's tokens, log-probabilities, finish and
cached prompt tokens."""

from __future__ import annotations

import ast

import pytest

from services.router.dispatch.job import Job
from services.router.upstream.protocols import PROTOCOLS
from shared.messages.sampling import SamplingParams
from tests.sglang_release import ROOT, load

EVERY = SamplingParams(
    max_tokens=7,
    temperature=0.5,
    top_p=0.9,
    top_k=20,
    seed=3,
    stop_token_ids=(2,),
    stop=("END",),
    ignore_eos=True,
    min_tokens=2,
    min_p=0.05,
    repetition_penalty=1.1,
    logit_bias=((11, 1.5),),
    presence_penalty=0.1,
    frequency_penalty=0.2,
    logprobs=2,
    prompt_logprobs=0,  # (refused before a server is asked: its fields' names checked here)
)
JOB = Job(
    "r1",
    "m",
    [1, 2, 3],
    EVERY,
    0.0,
    retention="agent",
    salt="s" * 8,
    fingerprint="f" * 16,
    block_size=32,
)


def test_vllms_generate_and_completions_bodies_are_fields_vllm_takes() -> None:
    pytest.importorskip("vllm", reason="the vllm extra")
    from vllm import SamplingParams as VllmParams
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    generate = PROTOCOLS["generate"].body(JOB, "served")
    parsed = GenerateRequest.model_validate(generate)  # (vLLM's own validation)
    assert parsed.token_ids == [1, 2, 3] and parsed.cache_salt == "s" * 8
    assert set(generate["sampling_params"]) <= set(VllmParams.__struct_fields__)
    sampling = parsed.sampling_params
    assert (sampling.max_tokens, sampling.top_k, sampling.seed, sampling.logprobs) == (7, 20, 3, 2)
    assert (sampling.min_tokens, sampling.min_p, sampling.repetition_penalty) == (2, 0.05, 1.1)
    assert sampling.extra_args == {"kvmesh_retention": "agent"} and sampling.stop == ["END"]
    completions = PROTOCOLS["completions"].body(JOB, "served")
    request = CompletionRequest.model_validate(completions)
    assert request.prompt == [1, 2, 3] and request.return_token_ids
    assert request.vllm_xargs == {"kvmesh_retention": "agent"}


def _fields(path, cls: str) -> set[str]:
    """A class's annotated fields (or its __init__'s parameters) in a file of the release."""
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    names = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
    for n in node.body:
        if isinstance(n, ast.FunctionDef) and n.name == "__init__":
            names |= {a.arg for a in n.args.args + n.args.kwonlyargs}
    return names


def test_sglangs_body_is_fields_its_pinned_release_takes() -> None:
    load()
    body = PROTOCOLS["sglang"].body(JOB, "served")
    request = _fields(ROOT / "sglang/srt/managers/io_struct.py", "GenerateReqInput")
    assert set(body) <= request, set(body) - request
    sampling = _fields(ROOT / "sglang/srt/sampling/sampling_params.py", "SamplingParams")
    assert set(body["sampling_params"]) <= sampling, set(body["sampling_params"]) - sampling
    assert body["sampling_params"]["stop"] == ["END"] and body["input_ids"] == [1, 2, 3]


def test_vllms_generate_stream_reads_into_tokens_logprobs_finish_and_cached() -> None:
    read = PROTOCOLS["generate"]
    # (chunks as vLLM 0.32's /inference/v1/generate streamed them)
    first = {
        "choices": [
            {
                "index": 0,
                "finish_reason": None,
                "stop_reason": None,
                "token_ids": [28],
                "logprobs": {
                    "content": [
                        {
                            "token_id": 28,
                            "logprob": -1.5,
                            "top_logprobs": [
                                {"token_id": 28, "logprob": -1.5},
                                {"token_id": 9, "logprob": -2.0},
                            ],
                        }
                    ]
                },
            }
        ],
        "usage": None,
    }
    (piece,) = read.pieces(first, 2)
    assert piece.token_ids == [28] and piece.finish is None
    assert piece.logprobs[0].top_ids == [28, 9] and piece.logprobs[0].logprob == -1.5
    last = {
        "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": "END", "token_ids": [5]}]
    }
    (piece,) = read.pieces(last, None)
    assert (piece.finish, piece.stop, piece.logprobs) == ("stop", "END", None)
    usage = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 32}}}
    assert read.ends(usage) and read.cached(usage) == 32 and not read.ends(last)


def test_sglangs_stream_reads_its_meta_info() -> None:
    read = PROTOCOLS["sglang"]
    assert read.pieces({"output_ids": [], "meta_info": {"finish_reason": None}}, None) == []
    chunk = {
        "output_ids": [7, 8],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": "END"},
            "cached_tokens": 64,
            "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]],
            "output_top_logprobs": [[[-0.1, 7, None]], [[-0.2, 8, None]]],
        },
    }
    (piece,) = read.pieces(chunk, 1)
    assert piece.token_ids == [7, 8] and (piece.finish, piece.stop) == ("stop", "END")
    assert [lp.top_ids for lp in piece.logprobs] == [[7], [8]]
    assert read.ends(chunk) and read.cached(chunk) == 64
    length = {"output_ids": [9], "meta_info": {"finish_reason": {"type": "length", "length": 3}}}
    assert read.pieces(length, None)[0].finish == "length"


def test_sglangs_server_info_says_where_its_kv_events_are_as_the_router_reads_it() -> None:
    """The router follows an SGLang server's events where its /server_info's ``kv_events``
    descriptor says (server.py): the keys it reads are the release's."""
    load()
    http = (ROOT / "sglang/srt/entrypoints/http_server.py").read_text()
    assert '@app.get("/server_info")' in http
    context = (ROOT / "sglang/srt/runtime_context.py").read_text()
    for key in ("endpoint_port_base", "replay_endpoint_port_base", "publisher"):
        assert f'"{key}"' in context, key
