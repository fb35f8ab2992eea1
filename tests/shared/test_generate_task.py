"""A generate task on the wire: the prompt's ids packed after the rest's JSON, read back
exactly; an older sender's JSON list still read; a damaged frame refused, naming the field."""

from __future__ import annotations

import json
import random

import pytest

from shared.kvstore.hashing import pack_tokens
from shared.messages.generate import GenerateTask, ImageRef
from shared.messages.sampling import SamplingParams


def fields(ids: list[int]) -> dict:
    return dict(
        request_id="r1",
        model="m",
        token_ids=ids,
        sampling=SamplingParams(temperature=0.5, max_tokens=7),
        reply_subject="reply",
        decode_id="d",
        decode_kv_address="127.0.0.1:1",
        deadline=12.5,
        block_hashes=["ab" * 16],
        images=[ImageRef(image_hash="h", start=3, tokens=2)],
        priority="flex",
        weight=3,
    )


@pytest.mark.parametrize("n", [0, 1, 77_000])
def test_a_task_reads_back_as_it_was_written(n) -> None:
    ids = [random.Random(n).randrange(0, 2**31 - 1) for _ in range(n)]
    for task in (GenerateTask(**fields(ids)), GenerateTask.of(pack_tokens(ids), **fields(ids))):
        back = GenerateTask.from_bytes(task.to_bytes())
        assert back.model_dump() == task.model_dump() and back.token_ids == ids
        again = GenerateTask.from_bytes(back.to_bytes())  # (a worker passing it on)
        assert again.model_dump() == task.model_dump()
        # In JSON alone (a log, a journal) the ids are base64, read back the same.
        assert GenerateTask.model_validate_json(task.model_dump_json()).model_dump() == (
            task.model_dump()
        )


def test_packed_ids_that_do_not_match_the_prompt_are_not_used() -> None:
    ids = [5, 6, 7]
    task = GenerateTask.of(pack_tokens([5, 6]), **fields(ids))  # (a prompt grown since)
    assert GenerateTask.from_bytes(task.to_bytes()).token_ids == ids


def test_an_older_senders_json_list_is_read() -> None:
    task = GenerateTask(**fields([1, 2, 3]))
    old = json.dumps(task.model_dump()).encode()  # ids as a JSON list, no packed part
    assert GenerateTask.from_bytes(old).model_dump() == task.model_dump()


@pytest.mark.parametrize("damage", ["truncated", "bad base64", "ids not a list", "head not JSON"])
def test_a_damaged_task_is_refused_naming_token_ids_or_the_head(damage) -> None:
    task = GenerateTask(**fields([1, 2, 3]))
    wire = task.to_bytes()
    body = json.loads(task.model_dump_json())
    data = {
        "truncated": wire[:-1],
        "bad base64": json.dumps({**body, "token_ids": "!!"}).encode(),
        "ids not a list": json.dumps({**body, "token_ids": {"a": 1}}).encode(),
        "head not JSON": b"{" + wire[wire.index(b"\x00") :],
    }[damage]
    with pytest.raises(ValueError) as err:
        GenerateTask.from_bytes(data)
    assert ("token_ids" in str(err.value)) == (damage != "head not JSON")
