"""Registry records as data (infra/registry.py): a removal keeps the experiment's last
declaration, so its topics stay readable and auditable; an experiment file's mistake
names the file once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.registry import (
    ExperimentSpec,
    RegistryError,
    RegistryFollower,
    decode_entry,
    decode_record,
    encode_removal,
    encode_spec,
    load_spec_file,
)

GOOD = {"experiment_id": "exp-ok", "prm": {"scorers": [{"path": "scoring_workers.scorers.LengthBudgetScorer"}]}}


def _spec() -> ExperimentSpec:
    spec = decode_record(b"exp-ok", json.dumps(GOOD).encode())
    assert spec is not None
    return spec


def test_a_removal_keeps_the_declaration_and_a_tombstone_keeps_nothing() -> None:
    spec = _spec()
    _, declared, _ = encode_spec(spec)
    assert decode_entry(b"exp-ok", declared) == (spec, None)
    assert decode_entry(b"exp-ok", encode_removal(spec)) == (None, spec)
    assert decode_record(b"exp-ok", encode_removal(spec)) is None  # a removal, for every reader of declarations
    assert decode_entry(b"exp-ok", None) == (None, None)


def test_a_removal_is_decoded_as_data_like_a_declaration() -> None:
    with pytest.raises(RegistryError, match=r"experiment 'other' \(removal\): the record declares 'exp-ok'"):
        decode_entry(b"other", encode_removal(_spec()))
    with pytest.raises(RegistryError, match="unknown key `removd`"):
        decode_entry(b"exp-ok", json.dumps({"removd": GOOD}).encode())


def test_the_follower_hands_a_removal_with_what_it_kept() -> None:
    class Record:
        key, value, offset, timestamp = b"exp-ok", encode_removal(_spec()), 7, 1000

    record = RegistryFollower._decode(Record())
    assert record.removal and record.spec is None and record.kept == _spec() and not record.error


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "prm:\n  scorers:\n    - path: x.Y\n      wieght: 1\n",
            "prm.scorers[0]: unknown key `wieght`; did you mean `weight`?",
        ),
        ("prm:\n  advantage_shaping:\n    mod: x\n", "prm.advantage_shaping: unknown key `mod`; did you mean `mode`?"),
    ],
)
def test_a_nested_key_error_in_an_experiment_file_names_the_file_once(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text("experiment_id: exp-ok\n" + text)
    with pytest.raises(RegistryError) as info:
        load_spec_file(path)
    assert str(info.value) == f"{path}: {message}"


def test_an_experiment_file_with_a_byte_order_mark_loads_and_a_folder_is_named(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode())
    assert load_spec_file(path) == _spec()
    with pytest.raises(RegistryError, match="is a folder, not a file"):
        load_spec_file(tmp_path)
