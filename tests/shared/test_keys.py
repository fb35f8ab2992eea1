"""The keys file: hashes only, JSON or TOML, errors that name the entry and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.security.keys import KeysFile, KeysFileError, key_hash, new_key


@pytest.mark.parametrize("name", ["keys.json", "keys.toml"])
def test_round_trip_keeps_hashes_never_keys(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    keys = KeysFile()
    key, entry = new_key("acme", "admin", rpm=10, tpm=1000, concurrency=2)
    keys.add(entry)
    keys.add(new_key("beta")[1])
    keys.write(path)
    text = path.read_text()
    assert key not in text and key_hash(key) in text
    assert path.stat().st_mode & 0o777 == 0o600
    back = KeysFile.read(path)
    assert back.keys == keys.keys
    back.revoke(entry.id)
    back.write(path)
    assert KeysFile.read(path).keys[0].revoked


def test_a_missing_file_has_no_keys(tmp_path: Path) -> None:
    assert KeysFile.read(tmp_path / "none.json").keys == []


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"id": "k"}, "entry 1: missing sha256, tenant"),
        ({"id": "k", "sha256": "0" * 64, "tenant": "a", "colour": 1}, "unknown colour"),
        ({"id": "k", "sha256": "0" * 64, "tenant": "a b"}, "tenant must be"),
        ({"id": "k", "sha256": "0" * 64, "tenant": "a", "role": "root"}, "role must be"),
        ({"id": "k", "sha256": "xyz", "tenant": "a"}, "sha256 must be 64 hex"),
        ({"id": "k", "sha256": "0" * 64, "tenant": "a", "rpm": -1}, "rpm must be"),
    ],
)
def test_bad_entries_are_named(tmp_path: Path, entry: dict, message: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [entry]}))
    with pytest.raises(KeysFileError) as err:
        KeysFile.read(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_revoking_an_unknown_key_is_named() -> None:
    with pytest.raises(KeysFileError, match="no key 'key_nope'"):
        KeysFile().revoke("key_nope")
