"""stride.model.gguf.read_gguf against the ``gguf`` package's own reader, on a file written by its writer: every
metadata value, and every tensor's type, dimensions and bytes (float, integer and block-quantised types, a 3-D
tensor, a custom alignment); a truncated file and a file that is not GGUF are refused."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from stride.model.gguf import read_gguf, read_gguf_metadata


def _write(path: Path, alignment: int) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_string("general.name", "tiny ünïcode")
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b", "ab", ""])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.0, -3.25, 1.0])
    w.add_array("tokenizer.ggml.token_type", [3, 1, 1, 1, 1])
    w.add_tensor("f32", rng.standard_normal((3, 40), dtype=np.float32))  # 120 floats: the next start is unaligned
    w.add_tensor("f16", rng.standard_normal(7).astype(np.float16))
    w.add_tensor("i32", np.arange(5, dtype=np.int32))
    w.add_tensor("experts", rng.standard_normal((2, 3, 64), dtype=np.float32))
    for qtype in ("Q8_0", "Q4_1", "Q4_0"):
        q = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(qtype.lower(), gguf.quants.quantize(rng.standard_normal((6, 96), dtype=np.float32), q),
                     raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [32, 64])
def test_read_gguf_gives_what_the_gguf_package_reads(tmp_path: Path, alignment: int) -> None:
    path = tmp_path / "m.gguf"
    _write(path, alignment)
    ours, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its own bookkeeping
    assert ours.fields == want
    assert ours.fields["general.alignment"] == alignment
    assert read_gguf_metadata(path) == want
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(b.shape.tolist()), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
        assert not a.data.flags.writeable
    by_name = {t.name: t for t in ours.tensors}
    assert by_name["experts"].data.shape == (2, 3, 64) and by_name["q4_1"].data.shape == (6, 3 * 20)
    # Negative control: the data read from 32 bytes earlier (a start that ignored the file's alignment could give)
    # are other values, which the comparison above would refuse.
    if alignment == 64:
        first = by_name["f32"].data
        start = theirs.tensors[0].data_offset
        assert start % 64 == 0
        raw = np.fromfile(path, dtype=np.uint8)
        shifted = raw[start - 32 : start - 32 + first.nbytes].view(np.float32).reshape(first.shape)
        assert not np.array_equal(shifted, first)


def test_read_gguf_refuses_truncated_and_foreign_files(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write(path, 32)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="ends past the end of the file"):
        read_gguf(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + path.read_bytes()[4:])
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        read_gguf(other)
