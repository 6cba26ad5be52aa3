"""read_gguf against gguf's own GGUFReader on the real SmolLM2 file: the same metadata (outside
tokenizer.ggml., whose arrays only keep their lengths) and the same tensors, byte for byte."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from splitserve.engine.gguf_file import read_gguf


def test_metadata_and_tensors_equal_gguf_readers(smollm2_path: str) -> None:
    from gguf import GGUFReader

    reference = GGUFReader(smollm2_path)
    ours = read_gguf(smollm2_path)
    expected = {
        key: field.contents()
        for key, field in reference.fields.items()
        if not key.startswith(("tokenizer.ggml.", "GGUF."))  # GGUF.*: the reader's header
    }
    assert ours.metadata == expected
    arrays = {
        key: len(field.data)
        for key, field in reference.fields.items()
        if key.startswith("tokenizer.ggml.") and len(field.types) > 1  # an array's types
    }
    assert ours.array_lengths == arrays
    assert ours.array_lengths["tokenizer.ggml.tokens"] == 49152
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert (mine.tensor_type, mine.shape) == (theirs.tensor_type, tuple(theirs.shape.tolist()))
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf(str(path))
