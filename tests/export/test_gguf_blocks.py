"""GGUF blocks carried over as BlockQuantized: exact against gguf's own dequantization, HF names, Q/K rows."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from specdec_edge.errors import ExportError  # noqa: E402
from specdec_edge.export.gguf_blocks import (  # noqa: E402
    blocks_from_raw,
    gguf_linear_types,
    gguf_linear_weights,
    hf_name,
    supported_types,
)

# Byte offsets of each supported type's fp16 fields (d, dmin / m) inside one block.
FP16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def random_blocks(qtype: str, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """Random raw bytes [rows, blocks * type_size] whose fp16 fields are finite (positive and negative)."""
    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[T[qtype]][1]
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        raw[..., at : at + 2] = (rng.standard_normal((rows, blocks, 1)) * 0.02).astype("<f2").view(np.uint8)
    return raw.reshape(rows, blocks * size)


def test_supported_types():
    assert set(supported_types()) == set(FP16_FIELDS)


@pytest.mark.parametrize("qtype", list(FP16_FIELDS))
def test_random_blocks_dequantize_like_gguf_bit_for_bit(qtype):
    raw = random_blocks(qtype, rows=6, blocks=2)
    w = blocks_from_raw(raw, qtype)
    want = gguf.quants.dequantize(raw, T[qtype])  # [N, K]
    assert w.shape == want.shape
    assert w.q.dtype == np.uint8 and w.q.max() < 2**w.bits
    assert w.scales.shape == w.zero.shape == (want.shape[0], want.shape[1] // w.block)
    np.testing.assert_array_equal(bits(w.dequantize()), bits(want))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
def test_gguf_quantized_weights_dequantize_like_gguf(qtype):
    w = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, T[qtype])
    got = blocks_from_raw(raw, qtype)
    np.testing.assert_array_equal(bits(got.dequantize()), bits(gguf.quants.dequantize(raw, T[qtype])))
    assert np.abs(got.dequantize() - w).max() < 0.5  # and it is that weight


def test_forms_of_the_common_types():
    q40 = blocks_from_raw(random_blocks("Q4_0", 2, 1), "Q4_0")
    assert (q40.bits, q40.block, q40.mins, int(q40.zero[0, 0])) == (4, 32, None, 8)
    q41 = blocks_from_raw(random_blocks("Q4_1", 2, 1), "Q4_1")
    assert (q41.bits, q41.block, int(q41.zero[0, 0])) == (4, 32, 0) and q41.mins.shape == (2, 1)
    q80 = blocks_from_raw(random_blocks("Q8_0", 2, 1), "Q8_0")
    assert (q80.bits, q80.block, q80.mins, int(q80.zero[0, 0])) == (8, 32, None, 128)
    q4k = blocks_from_raw(random_blocks("Q4_K", 2, 1), "Q4_K")
    assert (q4k.bits, q4k.block, q4k.scales.shape) == (4, 32, (2, 8))
    q6k = blocks_from_raw(random_blocks("Q6_K", 2, 1), "Q6_K")
    assert (q6k.bits, q6k.block, q6k.scales.shape, int(q6k.zero[0, 0])) == (8, 16, (2, 16), 32)


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ2_XXS", "TQ2_0", "MXFP4"])
def test_unsupported_type_is_a_clear_error(qtype):
    raw = np.zeros((2, GGML_QUANT_SIZES[T[qtype]][1] * 2), np.uint8)
    with pytest.raises(ExportError, match=rf"blk\.1\.ffn_up\.weight is {qtype}.*supported types: Q4_0, Q4_1"):
        blocks_from_raw(raw, qtype, "blk.1.ffn_up.weight")


# ---- whole files --------------------------------------------------------------------------------------------

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 96, 4, 2, 16, 40


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF llama's q_proj / k_proj rows (interleaves the rotary halves)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch: str, types: dict[str, str], permute: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny 2-layer decoder GGUF; returns the HF-layout fp32 weights it was quantized from, by GGUF name."""
    rng = np.random.default_rng(seed)
    shapes = {
        "attn_q": (HEADS * HEAD_DIM, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    hf = {}
    names = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN)}
    names |= {f"blk.{i}.{k}.weight": s for i in range(2) for k, s in shapes.items()}
    for name, shape in names.items():
        hf[name] = w = rng.standard_normal(shape).astype(np.float32)
        if permute and ".attn_q." in name:
            w = llama_permute(w, HEADS)
        if permute and ".attn_k." in name:
            w = llama_permute(w, KV_HEADS)
        qtype = types.get(name.split(".")[-2], "Q8_0")
        if qtype == "F32":
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, T[qtype]), raw_dtype=T[qtype])
    for i in range(2):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


LLAMA_TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "ffn_gate": "Q4_1", "output": "F32"}


def test_llama_file_names_and_exactness(tmp_path):
    path = tmp_path / "tiny-llama.gguf"
    hf = write_gguf(path, "llama", LLAMA_TYPES, permute=True)
    reader = gguf.GGUFReader(str(path))
    weights = gguf_linear_weights(path)

    # Names: the ones transformers maps these GGUF tensors to (gguf's name map, as transformers uses it).
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    linear = [t.name for t in reader.tensors if len(t.shape) == 2]
    for gguf_name in linear:
        assert name_map.get_name(hf_name(gguf_name)[: -len(".weight")]) + ".weight" == gguf_name
    assert set(weights) == {hf_name(n) for n in linear} - {"lm_head.weight"}  # the F32 head is left out
    assert gguf_linear_types(path)["lm_head.weight"] == "F32"
    assert gguf_linear_types(path)["model.layers.1.self_attn.k_proj.weight"] == "Q4_1"

    for t in reader.tensors:
        if hf_name(t.name) not in weights:
            continue
        got = weights[hf_name(t.name)].dequantize()  # [N, K]
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            assert not np.array_equal(got, want)  # rows really were reordered
            want = llama_unpermute(want, HEADS if ".attn_q." in t.name else KV_HEADS)
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=t.name)
        assert np.abs(got - hf[t.name]).max() < 0.5, t.name  # the HF-layout weight, not a permuted one


def llama_unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama_permute, built from it: row r of the permuted weight goes back where it came from."""
    source = llama_permute(np.arange(w.shape[0])[:, None], heads)[:, 0]
    out = np.empty_like(w)
    out[source] = w
    return out


def test_llama_qk_rows_match_transformers(tmp_path):
    processor_module = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    path = tmp_path / "tiny-llama.gguf"
    write_gguf(path, "llama", LLAMA_TYPES, permute=True)
    weights = gguf_linear_weights(path)
    processor = processor_module.LlamaTensorProcessor(config={"num_attention_heads": HEADS, "num_key_value_heads": 2})
    for t in gguf.GGUFReader(str(path)).tensors:
        if ".attn_q." in t.name or ".attn_k." in t.name:
            theirs = processor.process(weights=gguf.quants.dequantize(t.data, t.tensor_type), name=t.name).weights
            np.testing.assert_array_equal(bits(weights[hf_name(t.name)].dequantize()), bits(theirs), err_msg=t.name)


def test_gemma3_file_keeps_row_order(tmp_path):
    path = tmp_path / "tiny-gemma3.gguf"
    hf = write_gguf(path, "gemma3", {"attn_q": "Q4_0", "attn_k": "Q4_1", "ffn_down": "Q4_1"}, permute=False)
    weights = gguf_linear_weights(path, embedding=False)
    assert "model.embed_tokens.weight" not in weights and "lm_head.weight" in weights
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 2)
    for t in gguf.GGUFReader(str(path)).tensors:
        if hf_name(t.name) in weights:
            assert name_map.get_name(hf_name(t.name)[: -len(".weight")]) + ".weight" == t.name
            got = weights[hf_name(t.name)].dequantize()
            np.testing.assert_array_equal(bits(got), bits(gguf.quants.dequantize(t.data, t.tensor_type)))
            assert np.abs(got - hf[t.name]).max() < 0.5


def test_unsupported_tensor_in_a_file_names_it(tmp_path):
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(HEADS)
    raw = np.zeros((HIDDEN, GGML_QUANT_SIZES[T.IQ4_NL][1] * HIDDEN // 32), np.uint8)
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=T.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ExportError, match=r"blk\.0\.ffn_up\.weight \(model\.layers\.0\.mlp\.up_proj\.weight\) is IQ4_NL"
    ):
        gguf_linear_weights(path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ExportError, match="llama, qwen2, gemma3, not 'phi3'"):
        gguf_linear_weights(path)
