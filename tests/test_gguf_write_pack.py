"""twice's GGUF writer packs metadata arrays whole (weights/gguf_write._writer): the same bytes
as the gguf package's element-by-element packing, for every array kind twice writes."""

import gguf
import numpy as np

from twice.weights.gguf_write import _writer

T = gguf.GGUFValueType
VALUES = [
    (T.STRING, ["a", "Ġthe", "▁", "漢字", "🙂", "<|im_start|>", "x" * 300, ""]),
    (T.INT32, [0, 1, -1, 2**31 - 1, -(2**31), 7]),
    (T.FLOAT32, [0.0, -0.0, 1.5, -1e30, 3.4e38, float(np.float32(0.1)), -12345.678]),
    (T.BOOL, [True, False, True]),
    (T.UINT32, [1, 2, 3]),  # not packed whole: the package's own path
]


def test_arrays_pack_to_the_packages_bytes(tmp_path):
    theirs = gguf.GGUFWriter(tmp_path / "a.gguf", "llama")
    ours = _writer(tmp_path / "b.gguf", "llama")
    for sub, values in VALUES:
        for add_vtype in (True, False):
            want = theirs._pack_val(values, T.ARRAY, add_vtype, sub_type=sub)
            assert ours._pack_val(values, T.ARRAY, add_vtype, sub_type=sub) == want, (sub, add_vtype)
    # scalars and plain strings go through the package unchanged
    assert ours._pack_val("hello", T.STRING, True) == theirs._pack_val("hello", T.STRING, True)
    assert ours._pack_val(5, T.UINT32, True) == theirs._pack_val(5, T.UINT32, True)
