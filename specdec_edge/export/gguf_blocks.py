"""A GGUF file's quantized linear weights, carried over as they are: GGUF blocks -> ``BlockQuantized``.

Reads the raw block bytes with ``gguf.GGUFReader`` (no round through fp32, no second quantizer)
and returns each decoder linear weight under its Hugging Face state-dict name, in Hugging Face
layout ``[N, K]``. Every type below maps exactly: ``BlockQuantized.dequantize()`` equals
``gguf.quants.dequantize`` bit for bit (same fp32 products; a subtracted minimum becomes an added
negated one, which IEEE arithmetic rounds identically).

=======  ==========================================  ==============================================
GGUF     per block of the GGUF format                ``BlockQuantized`` (bits, block, zero, mins)
=======  ==========================================  ==============================================
Q4_0     d * (q - 8), q 4-bit, 32 values             4, 32, zero 8
Q4_1     d * q + m                                   4, 32, zero 0, mins m
Q5_0     d * (q - 16), q 5-bit                       8, 32, zero 16 (5-bit values widened to 8 bits)
Q5_1     d * q + m, q 5-bit                          8, 32, zero 0, mins m (widened)
Q8_0     d * q, q int8                               8, 32, stored q + 128, zero 128
Q2_K     d*sc * q - dmin*m per 16 (2-bit q)          4, 16, zero 0, scales d*sc, mins -dmin*m
Q3_K     d*(sc - 32) * q per 16, q in -4..3          4, 16, stored q + 4, zero 4
Q4_K     d*sc * q - dmin*m per 32 (6-bit sc, m)      4, 32, zero 0, scales d*sc, mins -dmin*m
Q5_K     as Q4_K with 5-bit q                        8, 32, zero 0 (widened), mins -dmin*m
Q6_K     d*sc * (q - 32) per 16, q 6-bit, sc int8    8, 16, zero 32 (widened)
=======  ==========================================  ==============================================

5- and 6-bit values are widened to 8 bits because ``MatMulNBits`` holds 4- or 8-bit values: still
exact, but such a tensor takes 9.25 to 10.5 bits per weight as MatMulNBits inputs (fp32 scales)
instead of GGUF's 5.5 to 6.6 (Q4_1: 6.1 instead of 5). Non-uniform or ternary types (IQ*, TQ*,
MXFP4, ...) have no such form and raise ``ExportError``; float weights
(F32, F16, BF16) are not block-quantized and are left out (the graph keeps them in fp32).

llama.cpp stores llama's Q and K projections with their rows permuted for its rotary layout;
they are un-permuted here as transformers does (rows of q, scales, zero and mins alike).
"""

from __future__ import annotations

import os
import re

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES

from specdec_edge.errors import ExportError
from specdec_edge.export.quant_weights import BlockQuantized

T = GGMLQuantizationType

# GGUF architecture -> whether llama.cpp permuted the rows of attn_q / attn_k (transformers un-permutes
# exactly these: its LlamaTensorProcessor; gemma3 and qwen2 use the rotary layout of Hugging Face).
ARCHITECTURES = {"llama": True, "qwen2": False, "gemma3": False}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face state-dict name of a decoder linear weight or the embedding, else None."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    return None


# ---- bit fields -------------------------------------------------------------------------------------------


def _fields(x: np.ndarray, width: int) -> np.ndarray:
    """Split each byte of x [..., n] into its 8/width fields of ``width`` bits, lowest first: [..., 8/width, n]."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]
    return (x[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def _f16(x: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes [..., 2] -> float32 [...]."""
    return np.ascontiguousarray(x).view("<f2")[..., 0].astype(np.float32)


def _flat(x: np.ndarray, sub: int) -> np.ndarray:
    """[N, nb, ...] values of super-blocks -> [N, nb * values / sub, sub] (sub-blocks of ``sub`` values)."""
    return x.reshape(x.shape[0], -1, sub)


def _out(bits: int, block: int, q: np.ndarray, scales: np.ndarray, zero: int, mins: np.ndarray | None = None):
    """BlockQuantized from q [N, nb', block] and per-block scales/mins [N, nb']."""
    n = q.shape[0]
    scales = scales.reshape(n, -1).astype(np.float32)
    zeros = np.full(scales.shape, zero, np.uint8)
    mins = None if mins is None else mins.reshape(n, -1).astype(np.float32)
    return BlockQuantized(bits, block, q.reshape(n, -1).astype(np.uint8), scales, zeros, mins)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes [..., 12] -> 8 six-bit scales and 8 six-bit minima, each [..., 8]."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], -1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], -1)
    return sc.astype(np.float32), mn.astype(np.float32)


# ---- one decoder per GGUF type: raw blocks [N, nb, type_size] uint8 -> BlockQuantized ------------------------


def _q4_0(b):
    q = _fields(b[..., 2:18], 4)  # [N, nb, 2, 16]: element 16 * field + j
    return _out(4, 32, q, _f16(b[..., 0:2]), 8)


def _q4_1(b):
    q = _fields(b[..., 4:20], 4)
    return _out(4, 32, q, _f16(b[..., 0:2]), 0, _f16(b[..., 2:4]))


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 values [N, nb, 32]: low nibbles from qs [N, nb, 16], bit j of the uint32 qh [N, nb, 4] on top."""
    high = _fields(qh, 1).swapaxes(-1, -2).reshape(*qh.shape[:-1], 32)  # bit j of the little-endian word
    return _fields(qs, 4).reshape(*qs.shape[:-1], 32) | (high << 4)


def _q5_0(b):
    return _out(8, 32, _five_bits(b[..., 2:6], b[..., 6:22]), _f16(b[..., 0:2]), 16)


def _q5_1(b):
    return _out(8, 32, _five_bits(b[..., 4:8], b[..., 8:24]), _f16(b[..., 0:2]), 0, _f16(b[..., 2:4]))


def _q8_0(b):
    return _out(8, 32, b[..., 2:34] ^ np.uint8(0x80), _f16(b[..., 0:2]), 128)  # int8 byte ^ 0x80 == int8 + 128


def _q2_k(b):
    sc, d, dmin = b[..., 0:16], _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
    q = _fields(b[..., 16:80].reshape(*b.shape[:2], 2, 32), 2)  # [N, nb, 2, 4, 32]
    return _out(4, 16, _flat(q, 16), d * (sc & 15), 0, -(dmin * (sc >> 4)))


def _q3_k(b):
    n, nb = b.shape[:2]
    high = _fields(b[..., 0:32], 1)  # [N, nb, 8, 32]
    low = _fields(b[..., 32:96].reshape(n, nb, 2, 32), 2)  # [N, nb, 2, 4, 32]
    q = low.reshape(n, nb, 256) | (high.reshape(n, nb, 256) << 2)  # q + 4: the format subtracts 4 where high is 0
    s = b[..., 96:108]
    sc = _fields(s[..., 0:8], 4).reshape(n, nb, 16) | (_fields(s[..., 8:12], 2).reshape(n, nb, 16) << 4)
    return _out(4, 16, _flat(q, 16), _f16(b[..., 108:110])[..., None] * (sc.astype(np.float32) - 32), 4)


def _q4_k(b):
    n, nb = b.shape[:2]
    sc, mn = _k_scales(b[..., 4:16])
    q = _fields(b[..., 16:144].reshape(n, nb, 4, 32), 4)  # [N, nb, 4, 2, 32]: sub-block 2 * chunk + field
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    return _out(4, 32, _flat(q, 32), d * sc, 0, -(dmin * mn))


def _q5_k(b):
    n, nb = b.shape[:2]
    sc, mn = _k_scales(b[..., 4:16])
    high = _fields(b[..., 16:48], 1)  # [N, nb, 8, 32]: bit i belongs to sub-block i
    low = _fields(b[..., 48:176].reshape(n, nb, 4, 32), 4).reshape(n, nb, 8, 32)
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    return _out(8, 32, _flat(low | (high << 4), 32), d * sc, 0, -(dmin * mn))


def _q6_k(b):
    n, nb = b.shape[:2]
    low = _fields(b[..., 0:128].reshape(n, nb, 2, 64), 4)  # [N, nb, 2, 2, 64]
    high = _fields(b[..., 128:192].reshape(n, nb, 2, 32), 2)  # [N, nb, 2, 4, 32]
    q = low.reshape(n, nb, 256) | (high.reshape(n, nb, 256) << 4)  # q + 32
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # [N, nb, 16]
    return _out(8, 16, _flat(q, 16), _f16(b[..., 208:210])[..., None] * sc, 32)


_DECODERS = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}


def supported_types() -> tuple[str, ...]:
    """Names of the GGUF quantization types whose blocks carry over exactly (e.g. ``"Q4_1"``)."""
    return tuple(t.name for t in _DECODERS)


def blocks_from_raw(raw: np.ndarray, qtype: GGMLQuantizationType | str, name: str = "tensor") -> BlockQuantized:
    """One GGUF tensor's raw bytes [N, bytes per row] (as ``GGUFReader`` gives them) -> BlockQuantized [N, K]."""
    qtype = T[qtype] if isinstance(qtype, str) else T(qtype)
    if qtype not in _DECODERS:
        raise ExportError(
            f"GGUF tensor {name} is {qtype.name}, which cannot be kept as block-quantized weights; "
            f"supported types: {', '.join(supported_types())}. "
            "Export this GGUF with --dtype int4, int8 or fp32 instead of --dtype gguf."
        )
    type_size = GGML_QUANT_SIZES[qtype][1]
    if raw.ndim != 2 or raw.dtype != np.uint8 or raw.shape[1] % type_size:
        raise ExportError(
            f"GGUF tensor {name} ({qtype.name}) has rows of {raw.shape[1:]} bytes, not whole {type_size}-byte blocks."
        )
    return _DECODERS[qtype](np.asarray(raw).reshape(raw.shape[0], -1, type_size))


# ---- whole files ------------------------------------------------------------------------------------------


def _field(reader: GGUFReader, key: str, default=None):
    return reader.fields[key].contents() if key in reader.fields else default


def _unpermute_rows(n: int, heads: int) -> np.ndarray:
    """Source rows that undo llama.cpp's Q/K permutation: per head, the even rows then the odd rows."""
    return np.arange(n).reshape(heads, -1, 2).swapaxes(1, 2).reshape(n)


def _take_rows(w: BlockQuantized, rows: np.ndarray) -> BlockQuantized:
    mins = None if w.mins is None else w.mins[rows]
    return BlockQuantized(w.bits, w.block, w.q[rows], w.scales[rows], w.zero[rows], mins)


def _linear_tensors(reader: GGUFReader) -> list:
    """(HF name, ReaderTensor) of every 2-D decoder linear weight and the embedding, in file order."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ExportError(
            f"keeping GGUF blocks supports the GGUF architectures {', '.join(ARCHITECTURES)}, not {arch!r}."
        )
    return [(hf_name(t.name), t) for t in reader.tensors if len(t.shape) == 2 and hf_name(t.name)]


def gguf_linear_types(gguf_path: str | os.PathLike) -> dict[str, str]:
    """HF name -> GGUF type name (``"Q4_1"``, ``"F32"``, ...) of every decoder linear weight and the embedding."""
    return {name: t.tensor_type.name for name, t in _linear_tensors(GGUFReader(gguf_path))}


def gguf_linear_weights(gguf_path: str | os.PathLike, embedding: bool = True) -> dict[str, BlockQuantized]:
    """Every quantized decoder linear weight of a GGUF file as BlockQuantized, under its Hugging Face name.

    Keys are ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``,
    ``lm_head.weight`` when the file has its own ``output.weight``, and ``model.embed_tokens.weight`` (unless
    ``embedding`` is False). A file without ``output.weight`` ties the LM head to the embedding. Weights stored
    as floats are left out; a quantized weight of an unsupported type raises ``ExportError``.
    """
    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    if ARCHITECTURES.get(arch) and not isinstance(heads, int):
        raise ExportError(f"{gguf_path}: {arch}.attention.head_count is {heads!r}; un-permuting Q/K needs one number.")
    out = {}
    for name, t in _linear_tensors(reader):
        if t.tensor_type in _FLOAT_TYPES or (name == "model.embed_tokens.weight" and not embedding):
            continue
        w = blocks_from_raw(t.data, t.tensor_type, f"{t.name} ({name})")  # [N, K]
        if ARCHITECTURES[arch] and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            w = _take_rows(w, _unpermute_rows(w.shape[0], heads if ".attn_q." in t.name else kv_heads))
        out[name] = w
    return out
