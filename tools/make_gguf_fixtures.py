#!/usr/bin/env python3
"""Writes the small GGUF fixtures used by tests/io/test_gguf.cpp.

The oracle is the upstream Python `gguf` package (gguf-py, tested with 0.19):
  * gguf.GGUFWriter writes the files,
  * gguf.quants.quantize produces the quantised blocks where gguf-py can quantise
    (BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); for the K-quants, which gguf-py can only
    dequantise, the blocks are deterministic random bytes with sane f16 scales,
  * gguf.GGUFReader re-reads every written file and the manifest (tensor name, type,
    absolute data offset, byte size, ne) is taken from what it reports,
  * gguf.quants.dequantize turns the raw tensor bytes (as located by GGUFReader) into
    the reference fp32 values, stored as raw little-endian float32:
        <stem>.<tensor name>.f32

Nothing here depends on the C++ reader. Run from anywhere:
    python3 tools/make_gguf_fixtures.py [out_dir]
Output is deterministic (fixed numpy seeds); total size is kept well under 300 KB.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "fixtures" / "gguf"

# Byte offsets of the f16 scale fields inside one block of each K-quant
# (ggml block layouts: Q2_K {scales[16], qs[64], d, dmin}, Q3_K {hmask[32], qs[64],
# scales[12], d}, Q4_K {d, dmin, scales[12], qs[128]}, Q5_K {d, dmin, scales[12],
# qh[32], qs[128]}, Q6_K {ql[128], qh[64], scales[16], d}).
K_SCALE_FIELDS = {
    T.Q2_K: {"d": 80, "dmin": 82},
    T.Q3_K: {"d": 108},
    T.Q4_K: {"d": 0, "dmin": 2},
    T.Q5_K: {"d": 0, "dmin": 2},
    T.Q6_K: {"d": 208},
}


def random_k_blocks(rng: np.random.Generator, qtype: T, rows: int, blocks_per_row: int) -> np.ndarray:
    """Random K-quant rows (uint8, shape (rows, blocks*type_size)) with finite f16 scales."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for field, off in K_SCALE_FIELDS[qtype].items():
        mag = rng.uniform(1e-3, 0.25, size=rows * blocks_per_row).astype(np.float32)
        sign = np.where(rng.random(rows * blocks_per_row) < 0.2, -1.0, 1.0).astype(np.float32)
        if field == "dmin":
            mag = mag * 0.5
        raw[:, off:off + 2] = (mag * sign).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks_per_row * type_size)


def quantized(rng: np.random.Generator, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    data = rng.standard_normal(size=shape).astype(np.float32)
    # a few larger outliers and an all-zero row exercise extreme scales
    data.reshape(-1)[::37] *= 9.0
    data.reshape(-1, shape[-1])[0, :] = 0.0
    return gguf.quants.quantize(data, qtype)


def write_types_fixture(path: Path) -> None:
    rng = np.random.default_rng(20240607)
    w = gguf.GGUFWriter(path, arch="llama")
    # ---- metadata of every kind ----
    w.add_name("talon fixture")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_float32("test.f32", 1.5)
    w.add_uint64("test.u64", 12345678901234)
    w.add_uint64("test.u64_max", 2**64 - 1)
    w.add_int64("test.i64", -(2**62) - 7)
    w.add_float64("test.f64", 3.141592653589793)
    w.add_bool("test.bool_t", True)
    w.add_bool("test.bool_f", False)
    w.add_string("test.str", "h\u00e9llo w\u00f6rld")
    w.add_array("test.str_arr", ["a", "", "\u00fcn\u00ef", "tokens with spaces"])
    w.add_array("test.i32_arr", [1, -2, 3, 2147483647])
    w.add_array("test.f32_arr", [0.5, -0.25, 1e-3])
    w.add_array("test.bool_arr", [True, False, True])
    w.add_array("test.nested", [[1, 2, 3], [4], [5, 6]])
    w.add_array("test.nested_str", [["x", "y"], ["z"]])
    w.add_key_value("test.u16_arr", [1, 65535], V.ARRAY, sub_type=V.UINT16)

    # ---- tensors: numpy shape (rows..., ne0); GGUF ne is the reverse ----
    w.add_tensor("t.f32", rng.standard_normal(size=(2, 3, 5)).astype(np.float32))
    w.add_tensor("t.f32_4d", rng.standard_normal(size=(2, 1, 3, 4)).astype(np.float32))
    w.add_tensor("t.f16", rng.standard_normal(size=(3, 7)).astype(np.float16))
    w.add_tensor("t.f64", rng.standard_normal(size=(5,)).astype(np.float64))
    w.add_tensor("t.i8", rng.integers(-128, 128, size=(3, 4), dtype=np.int8))
    w.add_tensor("t.i16", rng.integers(-32768, 32768, size=(9,), dtype=np.int16))
    w.add_tensor("t.i32", rng.integers(-2**31, 2**31, size=(2, 3), dtype=np.int32))
    w.add_tensor("t.i64", np.array([0, 1, -1, 2**40 + 3], dtype=np.int64))
    bf = rng.standard_normal(size=(3, 11)).astype(np.float32)
    w.add_tensor("t.bf16", gguf.quants.quantize(bf, T.BF16), raw_dtype=T.BF16)
    for qt, shape in [(T.Q4_0, (5, 64)), (T.Q4_1, (3, 96)), (T.Q5_0, (5, 64)),
                      (T.Q5_1, (3, 32)), (T.Q8_0, (7, 64))]:
        w.add_tensor("t." + qt.name.lower(), quantized(rng, qt, shape), raw_dtype=qt)
    for qt, rows, nb in [(T.Q2_K, 3, 1), (T.Q3_K, 3, 1), (T.Q4_K, 3, 2), (T.Q5_K, 1, 1), (T.Q6_K, 3, 2)]:
        w.add_tensor("t." + qt.name.lower(), random_k_blocks(rng, qt, rows, nb), raw_dtype=qt)
    # a 3-D quantised tensor (ne = [64, 3, 2])
    w.add_tensor("t.q8_0_3d", quantized(rng, T.Q8_0, (2, 3, 64)), raw_dtype=T.Q8_0)
    finish(w)


def write_small_fixture(path: Path, alignment: int | None, version: int | None) -> None:
    rng = np.random.default_rng(7 if alignment else 11)
    w = gguf.GGUFWriter(path, arch="gpt2")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint32("gpt2.context_length", 128)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "hello", "world", "!"])
    w.add_tensor("a", rng.standard_normal(size=(3, 5)).astype(np.float32))
    w.add_tensor("b", quantized(rng, T.Q4_0, (3, 32)), raw_dtype=T.Q4_0)
    w.add_tensor("c", rng.standard_normal(size=(1,)).astype(np.float16))
    finish(w)
    if version is not None:
        # GGUF v2 and v3 are byte-identical for little-endian files except for the
        # version field (v3 only added big-endian support), so patch it in place.
        with open(path, "r+b") as f:
            f.seek(4)
            f.write(np.uint32(version).tobytes())


def write_metadata_only(path: Path) -> None:
    w = gguf.GGUFWriter(path, arch="bert")
    w.add_uint32("bert.block_count", 2)
    w.add_string("general.name", "no tensors")
    finish(w)


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_references(path: Path) -> None:
    """Reads `path` back with gguf.GGUFReader; writes the manifest and reference values."""
    r = gguf.GGUFReader(path)
    raw = path.read_bytes()
    stem = path.stem
    lines = [f"version {int(r.fields['GGUF.version'].parts[-1][0])}",
             f"alignment {r.alignment}",
             f"data_offset {r.data_offset}"]
    for t in r.tensors:
        qt = T(int(t.tensor_type))
        ne = [int(x) for x in t.shape]  # GGUFReader reports ne in file order (ne[0] first)
        lines.append(" ".join(["tensor", t.name, str(int(qt)), str(int(t.data_offset)),
                               str(int(t.n_bytes)), str(len(ne))] + [str(x) for x in ne]))
        blob = np.frombuffer(raw, dtype=np.uint8, count=int(t.n_bytes), offset=int(t.data_offset))
        if qt in (T.F32, T.F16, T.BF16) or gguf.GGML_QUANT_SIZES[qt][0] > 1:
            block, tsize = gguf.GGML_QUANT_SIZES[qt]
            rows = blob.reshape(-1, ne[0] // block * tsize)
            ref = gguf.quants.dequantize(rows, qt)
        else:  # plain integer / f64 tensors: numpy's own conversion is the oracle
            np_type = {T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
                       T.I32: np.int32, T.I64: np.int64}[qt]
            ref = blob.view(np.dtype(np_type).newbyteorder("<")).astype(np.float32)
        ref = np.ascontiguousarray(ref, dtype=np.float32).reshape(-1)
        assert ref.size == t.n_elements, (t.name, ref.size, t.n_elements)
        assert np.all(np.isfinite(ref)), t.name
        ref.astype("<f4").tofile(path.parent / f"{stem}.{t.name}.f32")
    (path.parent / f"{stem}.manifest.txt").write_text("\n".join(lines) + "\n")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for p in OUT.glob("*"):
        if p.suffix in (".gguf", ".f32", ".txt"):
            p.unlink()
    files = [OUT / "types_v3.gguf", OUT / "small_v2.gguf", OUT / "align64.gguf", OUT / "no_tensors.gguf"]
    write_types_fixture(files[0])
    write_small_fixture(files[1], alignment=None, version=2)
    write_small_fixture(files[2], alignment=64, version=None)
    write_metadata_only(files[3])
    for f in files:
        write_references(f)
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {len(list(OUT.iterdir()))} files, {total} bytes, to {OUT}")
    assert total < 300 * 1024


if __name__ == "__main__":
    main()
