#!/usr/bin/env python3
"""Writes tests/fixtures/gguf/quant_blocks.gguf: for each block format Corral decodes, a
tensor `<TYPE>` of 3 x 512 values in that format and `<TYPE>.ref`, the same values decoded to
f32 by the `gguf` package (whose decoders match ggml's bit for bit), plus metadata of every
value type for the header tests.

Run in a venv with `pip install gguf numpy`:
    python scripts/make_gguf_fixtures.py
Formats the package can quantize (Q4_0 .. Q8_0, BF16, F16) are quantized from random normal
values; for the k-quants, which it only decodes, the blocks are random bytes with their f16
scale fields set to finite values of a weight's size.
"""
import pathlib

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/gguf/quant_blocks.gguf"
ROWS, COLS = 3, 512
rng = np.random.default_rng(2026)


def random_kquant(qtype, scale_offsets):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(ROWS * COLS // block, size), dtype=np.uint8)
    for off in scale_offsets:
        scales = (rng.uniform(1e-4, 2e-2, size=blocks.shape[0])).astype(np.float16)
        blocks[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(ROWS, -1)


writer = gguf.GGUFWriter(str(OUT), "corral-test")
writer.add_uint8("test.u8", 200)
writer.add_int8("test.i8", -100)
writer.add_uint16("test.u16", 60000)
writer.add_int16("test.i16", -30000)
writer.add_uint32("test.u32", 4_000_000_000)
writer.add_int32("test.i32", -2_000_000_000)
writer.add_uint64("test.u64", 2**63 + 5)
writer.add_int64("test.i64", -(2**62))
writer.add_float32("test.f32", 0.15625)
writer.add_float64("test.f64", -2.5e300)
writer.add_bool("test.bool", True)
writer.add_string("test.string", "héllo ✓")
writer.add_array("test.strings", ["a", "bc", ""])
writer.add_array("test.ints", [1, 2, 3])
writer.add_array("test.nested", [[1, 2], [3]])

values = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
for qtype in [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]:
    raw = gguf.quants.quantize(values, qtype)
    writer.add_tensor(qtype.name, raw, raw_dtype=qtype)
    writer.add_tensor(qtype.name + ".ref", gguf.quants.dequantize(raw, qtype).astype(np.float32))
# k-quants: the byte offsets of their f16 scales (d and dmin first for Q4_K/Q5_K, d last for Q6_K).
for qtype, offsets in [(T.Q4_K, [0, 2]), (T.Q5_K, [0, 2]), (T.Q6_K, [208])]:
    raw = random_kquant(qtype, offsets)
    writer.add_tensor(qtype.name, raw, raw_dtype=qtype)
    writer.add_tensor(qtype.name + ".ref", gguf.quants.dequantize(raw, qtype).astype(np.float32))

writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
