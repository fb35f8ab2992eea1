"""kvmesh's GGUF reader against the ``gguf`` package's own writer and reader: the same fields
and the same tensor data, for every kind of value and the tensor types kvmesh serves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from shared.model.gguf import GGUFError, find_gguf, reader
from shared.model.gguf_file import GGML_TYPES, GGUFFile


def written(path: Path, alignment: int) -> Path:
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_int32("t.i32", -(2**31))
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.text", "héllo ✓")
    w.add_array("t.strings", ["", "a", "Ġthe", "日本"] * 50)
    w.add_array("t.ints", list(range(-5, 1000)))
    w.add_array("t.floats", [0.5, -1.25, 3.0])
    w.add_key_value("t.nested", [[1, 2], [3]], GGUFValueType.ARRAY, GGUFValueType.ARRAY)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 64)).astype(np.float16))
    x = rng.standard_normal((8, 64)).astype(np.float32)
    for kind in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1):
        w.add_tensor(kind.name, quantize(x, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [32, 64])
def test_the_reader_reads_what_ggufs_writer_wrote_as_ggufs_reader_does(
    tmp_path: Path, alignment: int
) -> None:
    path = written(tmp_path / "m.gguf", alignment)
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields["t.nested"] == [[1, 2], [3]]  # (gguf's flattens it: [1, 2, 3])
    assert {**ours.fields, "t.nested": None} == {**expected, "t.nested": None}
    assert ours.fields["t.u64"] == 2**63 + 5 and ours.fields["t.text"] == "héllo ✓"
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, gguf_one in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == gguf_one.tensor_type.value
        assert mine.type_name == gguf_one.tensor_type.name
        assert mine.data.dtype == gguf_one.data.dtype
        assert mine.data.shape == gguf_one.data.shape
        assert np.array_equal(mine.data, gguf_one.data)
        assert not mine.data.flags.writeable  # (a view of the file: a copy is the caller's)


def test_the_tensor_types_are_ggufs() -> None:
    theirs = {t.value: (t.name, *sizes) for t, sizes in GGML_QUANT_SIZES.items()}
    assert theirs == GGML_TYPES


def test_the_bundled_model_reads_as_ggufs_reader_reads_it() -> None:
    path = find_gguf()
    ours, theirs = reader(path), GGUFReader(str(path))
    assert ours.fields["tokenizer.ggml.tokens"] == theirs.fields["tokenizer.ggml.tokens"].contents()
    assert len(ours.fields["tokenizer.ggml.merges"]) > 40_000
    for mine, gguf_one in zip(ours.tensors[:3], theirs.tensors[:3], strict=True):
        assert mine.name == gguf_one.name and np.array_equal(mine.data, gguf_one.data)


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda b: b"GGML" + b[4:], "not a GGUF file"),
        (lambda b: b[:4] + (9).to_bytes(4, "little") + b[8:], "GGUF version 9"),
        (lambda b: b[:200], "damaged or cut short at byte"),  # inside the metadata
        (lambda b: b[:-100], "damaged or cut short at byte"),  # inside the tensors
    ],
)
def test_a_damaged_file_is_a_clear_error(tmp_path: Path, damage, said: str) -> None:  # noqa: ANN001
    path = written(tmp_path / "m.gguf", 32)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(GGUFError, match=said):
        reader(path)
