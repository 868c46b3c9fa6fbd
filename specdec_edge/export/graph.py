"""Build the decoder ONNX graph of the engine contract directly from a model's weights.

Two flavours over the same contract (see docs/DESIGN.md):

* ``ort``: ONNX Runtime's fused ``com.microsoft.GroupQueryAttention`` with rotary inside
  and a shared past/present buffer: each layer's cache is bound as input and output and
  written in place at slots ``past .. past+S-1``.
* ``portable``: standard ONNX ops only (opset 17), for TensorRT: rotary by Gather of
  cos/sin tables, ``ScatterElements`` of the new K/V into the fixed buffers, attention
  over the first ``past+S`` slots.

Both take ``attention_bias`` ``[B, 1, S, past+S]`` (0 = attend, -inf = masked) so a tree
of draft tokens (siblings sharing a position id) is verified in one pass. The ``ort`` flavour also
takes it as wide as the cache capacity (``GraphSpec.capacity_bias``): fixed-shape decode passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specdec_edge.export.arch import ArchSpec
from specdec_edge.export.quant_weights import (
    BlockQuantized,
    ChannelQuantized,
    quantize_blocks,
    quantize_channels,
)

OPSET = 17
IR_VERSION = 10  # ONNX Runtime 1.32 reads IR <= 13; onnx 1.23 would write 14.
NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}
# MatMulNBits compute: 4 = int8 activations (quantized per block of each row, like llama.cpp's Q8 dot
# products); 0/1 = fp32 activations, ~3x slower on this CPU (docs/PERFORMANCE.md).
ACCURACY_LEVEL = 4


@dataclass
class DecoderConfig:
    """Everything the builder needs to know about one decoder, independent of transformers."""

    arch: ArchSpec
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    attn_scale: float
    layer_types: list  # per layer: "full_attention" | "sliding_attention"
    sliding_window: int | None
    rope: dict  # layer type -> (cos, sin) float32 [capacity, head_dim // 2]
    final_logit_softcap: float | None = None
    weights: dict = field(default_factory=dict)  # HF state-dict names -> float32 numpy
    # HF weight names -> quantized forms to use as they are (e.g. a GGUF's own blocks); others follow ``dtype``
    quantized: dict = field(default_factory=dict)


class Builder:
    """A tiny ONNX graph builder: named initializers, constants and nodes."""

    def __init__(self):
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self._consts: dict = {}
        self._n = 0

    def fresh(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.array(array, order="C"), name))  # keeps 0-d arrays 0-d
        return name

    def const(self, value, dtype=np.int64) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.init(self.fresh("const"), arr)
        return self._consts[key]

    def op(self, op_type: str, *inputs, outputs: int = 1, domain: str = "", hint: str | None = None, **attrs):
        names = [self.fresh(hint or op_type.lower()) for _ in range(outputs)]
        self.nodes.append(
            helper.make_node(op_type, list(inputs), names, name=self.fresh("n_" + op_type), domain=domain, **attrs)
        )
        return names[0] if outputs == 1 else names

    def rename_output(self, value: str, name: str) -> str:
        self.nodes.append(helper.make_node("Identity", [value], [name], name=self.fresh("n_out")))
        return name


def build_decoder(
    cfg: DecoderConfig, *, flavour: str, dtype: str, capacity: int, hidden_states: bool, feature_layers=()
) -> onnx.ModelProto:
    """Build the decoder graph.

    ``hidden_states``: also output the final-norm hidden states [B, S, H] (EAGLE, Medusa heads).
    ``feature_layers``: also output ``layer_features`` [B, S, n*H], the residual stream entering each
    of these layers (k = after k decoder layers; 0 = the embedding), concatenated in that order
    (EAGLE-3 heads; the numbering of vLLM's ``eagle_aux_hidden_state_layer_ids``).

    ``dtype``: "fp32" or "fp16" weights everywhere; "int8": linear layers as int8 per channel, each
    activation row quantized with its own scale (``MatMulInteger``); "int4": linear layers as 4-bit
    blocks (``MatMulNBits``). Weights in ``cfg.quantized`` are used as they are, whatever ``dtype``.
    Norms, the embedding table and the cache stay fp32 (fp16 for "fp16").

    A tied model (LM head == embedding) stores the table once (``tied_weights``): the embedding
    Gather and the LM head read the same initializer(s).
    """
    if flavour not in ("ort", "portable"):
        raise ValueError(f"unknown flavour {flavour}")
    wdt = np.dtype(np.float16 if dtype == "fp16" else np.float32)
    elem = NP_TO_ONNX[wdt]
    b = Builder()
    w = dict(cfg.weights)  # local: the tied LM head is added below
    qmap = dict(cfg.quantized)
    H, nh, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    arch = cfg.arch

    def norm_weight(name):
        return b.init(name, (w[name] + arch.norm_offset).astype(wdt))

    def rms_norm(x, wname):
        if flavour == "ort":
            return b.op(
                "SimplifiedLayerNormalization", x, norm_weight(wname), axis=-1, epsilon=cfg.rms_eps, stash_type=1
            )
        xf = b.op("Cast", x, to=TensorProto.FLOAT) if wdt == np.float16 else x
        ms = b.op("ReduceMean", b.op("Mul", xf, xf), axes=[-1], keepdims=1)
        inv = b.op("Reciprocal", b.op("Sqrt", b.op("Add", ms, b.const(cfg.rms_eps, np.float32))))
        y = b.op("Mul", xf, inv)
        if wdt == np.float16:
            y = b.op("Cast", y, to=elem)
        return b.op("Mul", y, norm_weight(wname))

    def quantized(name):
        """The quantized form of weight ``name`` [N, K], or None to keep it float."""
        if name in qmap:
            return qmap[name]
        if dtype == "int4":
            return quantize_blocks(w[name])
        if dtype == "int8":
            return quantize_channels(w[name])
        return None

    row_scales = {}  # activation -> (its rows as uint8 around 128, their scales [B, S, 1]): once per input

    def quantize_rows(x):  # x [B, S, K] fp32, each row by its own absmax: a row's integers ignore other rows
        if x not in row_scales:
            absmax = b.op("ReduceMax", b.op("Abs", x), axes=[-1], keepdims=0)  # [B, S]
            scale = b.op("Max", b.op("Mul", absmax, b.const(1 / 127, np.float32)), b.const(1e-30, np.float32))
            rows = b.op("Reshape", scale, b.const([-1]))  # [B*S]: one scale per row (batch 1)
            zero = b.op("Expand", b.const(128, np.uint8), b.op("Shape", rows))
            xq = b.op("QuantizeLinear", x, rows, zero, axis=1)  # round(x / scale) + 128, per row
            row_scales[x] = (xq, b.op("Unsqueeze", scale, b.const([-1])))
        return row_scales[x]

    stored = {}  # weight name -> its quantized initializers, written once (a tied table is read twice)

    def quantized_inits(name, q):
        if name not in stored:
            if isinstance(q, ChannelQuantized):
                wq = (q.q.T.astype(np.int16) + 128).astype(np.uint8)  # [K, N]: uint8 around 128
                stored[name] = {
                    "q.T": b.init(name + ".q.T", np.ascontiguousarray(wq)),
                    "scales": b.init(name + ".scales", q.scales),
                }
            else:
                data, scales, zero = q.packed()
                stored[name] = {
                    "q": b.init(name + ".q", data),
                    "scales": b.init(name + ".scales", scales),
                    "zero_points": b.init(name + ".zero_points", zero),
                }
                if q.mins is not None:
                    stored[name]["mins.T"] = b.init(name + ".mins.T", np.ascontiguousarray(q.mins.T))
        return stored[name]

    def quantized_matmul(x, name, q):
        """x [B, S, K] @ q.T -> [B, S, N] for one quantized weight ``q`` (initializers named after ``name``)."""
        n, k = q.q.shape
        inits = quantized_inits(name, q)
        if isinstance(q, ChannelQuantized):
            # uint8 x uint8 around 128: exact int32 sums on every x86 CPU (uint8 x int8 saturates 16-bit pair
            # sums on AVX2 without VNNI: measured, docs/PERFORMANCE.md).
            xq, xscale = quantize_rows(x)
            zero = b.const(128, np.uint8)
            acc = b.op("MatMulInteger", xq, inits["q.T"], zero, zero)
            # exact int32 sums x column scales (one op), then row scales
            y = b.op("DequantizeLinear", acc, inits["scales"], axis=-1)
            return b.op("Mul", y, xscale)
        y = b.op(
            "MatMulNBits",
            x,
            inits["q"],
            inits["scales"],
            inits["zero_points"],
            domain="com.microsoft",
            K=k,
            N=n,
            bits=q.bits,
            block_size=q.block,
            accuracy_level=ACCURACY_LEVEL,
        )
        if q.mins is not None:  # + sum over each block of x times the block's minimum: [B, S, K/block] @ [K/block, N]
            blocks = b.op("Reshape", x, b.const([0, 0, k // q.block, q.block]))
            sums = b.op("ReduceSum", blocks, b.const([-1]), keepdims=0)
            y = b.op("Add", y, b.op("MatMul", sums, inits["mins.T"]))
        return y

    def quantized_rows(ids, name, q):
        """Rows ``ids`` [B, S] of the quantized weight ``q`` [N, K], dequantized in the graph from the same
        initializers the MatMul reads: [B, S, K] fp32, equal bit for bit to ``q.dequantize()[ids]``."""
        inits = quantized_inits(name, q)
        if isinstance(q, ChannelQuantized):  # q.T [K, N] uint8 around 128, scales [N]
            cols = b.op("Transpose", b.op("Gather", inits["q.T"], ids, axis=1), perm=[1, 2, 0])  # [B, S, K]
            vals = b.op("Sub", b.op("Cast", cols, to=TensorProto.FLOAT), b.const(128, np.float32))
            return b.op("Mul", vals, b.op("Unsqueeze", b.op("Gather", inits["scales"], ids, axis=0), b.const([-1])))
        n, k = q.shape
        nb = k // q.block
        data = b.op("Gather", inits["q"], ids, axis=0)  # [B, S, nb, block * bits / 8]
        if q.bits == 4:  # two values per byte, low nibble first
            high = b.op("BitShift", data, b.const(4, np.uint8), direction="RIGHT")
            low = b.op("Sub", data, b.op("BitShift", high, b.const(4, np.uint8), direction="LEFT"))
            data = b.op(
                "Concat", b.op("Unsqueeze", low, b.const([-1])), b.op("Unsqueeze", high, b.const([-1])), axis=-1
            )
        vals = b.op("Reshape", b.op("Cast", data, to=TensorProto.FLOAT), b.const([0, 0, nb, q.block]))
        per_block = lambda t: b.op("Unsqueeze", t, b.const([-1]))  # noqa: E731  [B, S, nb] -> [B, S, nb, 1]
        scales = b.op("Gather", b.op("Reshape", inits["scales"], b.const([n, nb])), ids, axis=0)  # [B, S, nb]
        rows = b.op("Mul", b.op("Sub", vals, b.const(float(q.zero.flat[0]), np.float32)), per_block(scales))
        if q.mins is not None:  # mins.T [nb, N]
            mins = b.op("Transpose", b.op("Gather", inits["mins.T"], ids, axis=1), perm=[1, 2, 0])  # [B, S, nb]
            rows = b.op("Add", rows, per_block(mins))
        return b.op("Reshape", rows, b.const([0, 0, k]))

    def project(x, prefixes, fused=None):
        """x @ the weights of ``prefixes`` stacked along N, as one MatMul where they quantize alike (``fused``
        names the stacked weight), plus their biases."""
        names = [p + ".weight" for p in prefixes]
        forms = [quantized(n) for n in names]
        name = fused or names[0]
        if all(f is None for f in forms):
            stacked = np.concatenate([w[n] for n in names], 0).T.astype(wdt)
            y = b.op("MatMul", x, b.init(name + ".T", stacked))
        elif (
            all(isinstance(f, BlockQuantized) for f in forms)
            and len({(f.bits, f.block, f.mins is None) for f in forms}) == 1
        ):
            y = quantized_matmul(x, name, BlockQuantized.concat(forms))
        elif all(isinstance(f, ChannelQuantized) for f in forms):
            joined = ChannelQuantized(np.concatenate([f.q for f in forms]), np.concatenate([f.scales for f in forms]))
            y = quantized_matmul(x, name, joined)
        else:  # quantized differently (e.g. a GGUF's Q4_K beside Q6_K): one MatMul each, then concatenated
            parts = [
                quantized_matmul(x, n, f) if f is not None else b.op("MatMul", x, b.init(n + ".T", w[n].T.astype(wdt)))
                for n, f in zip(names, forms)
            ]
            y = b.op("Concat", *parts, axis=-1)
        if prefixes[0] + ".bias" in w:
            bias = np.concatenate([w[p + ".bias"] for p in prefixes]).astype(wdt)
            y = b.op("Add", y, b.init((fused or prefixes[0]).removesuffix(".weight") + ".bias", bias))
        return y

    def linear(x, prefix):
        return project(x, [prefix])

    def activation(x):
        if arch.activation == "silu":
            return b.op("Mul", x, b.op("Sigmoid", x))
        # gelu with tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        c = lambda v: b.const(v, wdt)  # noqa: E731
        inner = b.op(
            "Mul", b.op("Add", x, b.op("Mul", b.op("Mul", b.op("Mul", x, x), x), c(0.044715))), c(np.sqrt(2 / np.pi))
        )
        return b.op("Mul", b.op("Mul", x, c(0.5)), b.op("Add", b.op("Tanh", inner), c(1.0)))

    # ---- inputs
    b.inputs += [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_bias", TensorProto.FLOAT, ["batch", 1, "seq", "total"]),
        # logits only for the last N new positions (prefill needs 1; verification needs all S)
        helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, [1]),
    ]
    for i in range(cfg.num_layers):
        for kind in ("key", "value"):
            b.inputs.append(
                helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", elem, ["batch", kvh, capacity, hd])
            )

    # ---- shared per-step values
    bias = b.op("Cast", "attention_bias", to=elem) if wdt == np.float16 else "attention_bias"
    bias_shape = b.op("Shape", "attention_bias")
    total = b.op("Gather", bias_shape, b.const(3), axis=0)  # int64 scalar: past + S
    seq = b.op("Gather", b.op("Shape", "input_ids"), b.const(1), axis=0)
    biases = {"full_attention": bias}
    if arch.sliding_window and "sliding_attention" in cfg.layer_types:
        # Local layers also mask keys at distance >= window from the query position.
        kpos = b.op("Range", b.const(0), total, b.const(1))
        qpos = b.op("Unsqueeze", "position_ids", b.const([1, 3]))
        far = b.op("GreaterOrEqual", b.op("Sub", qpos, kpos), b.const(cfg.sliding_window))
        biases["sliding_attention"] = b.op("Where", far, b.const(-np.inf, wdt), bias)
    if flavour == "ort":
        # GroupQueryAttention writes the new K/V at slots seqlens_k+1-S .. seqlens_k and attends up to seqlens_k.
        # seqlens_k is read from the bias's values, not its width: the last slot that some row attends to
        # (every new token attends to itself). So the bias may also span the whole capacity with later slots
        # masked, which gives every decode pass one shape (CUDA graphs: runtime/ort_gpu_engine.py).
        total32 = b.op("Cast", total, to=TensorProto.INT32)  # the bias width
        seen = b.op("ReduceMax", "attention_bias", axes=[1, 2], keepdims=0)  # [B, T]: 0 where some row attends
        slot_no = b.op(
            "Slice",
            b.const(np.arange(1, capacity + 1), np.float32),
            b.const([0]),
            b.op("Unsqueeze", total, b.const([0])),
        )
        attended = b.op("Where", b.op("Greater", seen, b.const(-np.inf, np.float32)), slot_no, b.const(0, np.float32))
        seqlens_k = b.op(  # [B] int32: the last attended slot
            "Cast",
            b.op("Sub", b.op("ReduceMax", attended, axes=[1], keepdims=0), b.const(1, np.float32)),
            to=TensorProto.INT32,
        )
        rope = {
            t: (b.init(f"cos_cache.{t}", c.astype(wdt)), b.init(f"sin_cache.{t}", s.astype(wdt)))
            for t, (c, s) in cfg.rope.items()
        }
    else:
        rope = {}
        for t, (c, s) in cfg.rope.items():
            cos = b.init(f"cos_table.{t}", np.concatenate([c, c], -1).astype(wdt))
            sin = b.init(f"sin_table.{t}", np.concatenate([s, s], -1).astype(wdt))
            # [B, 1, S, hd]
            rope[t] = tuple(
                b.op("Unsqueeze", b.op("Gather", tab, "position_ids", axis=0), b.const([1])) for tab in (cos, sin)
            )
        # cache slots of the new tokens: past .. past+S-1, shaped to broadcast over [B, kvh, S, hd]
        slots = b.op("Reshape", b.op("Range", b.op("Sub", total, seq), total, b.const(1)), b.const([1, 1, -1, 1]))

    def heads(x, n):  # [B, S, n*hd] -> [B, n, S, hd]
        return b.op("Transpose", b.op("Reshape", x, b.const([0, 0, n, hd])), perm=[0, 2, 1, 3])

    def rotate(x, cos, sin):  # x [B, n, S, hd]
        x1, x2 = b.op("Split", x, b.const([hd // 2, hd // 2]), axis=-1, outputs=2)
        rot = b.op("Concat", b.op("Neg", x2), x1, axis=-1)
        return b.op("Add", b.op("Mul", x, cos), b.op("Mul", rot, sin))

    def head_norm(x, n, wname):  # per-head RMSNorm on [B, S, n*hd]
        y = rms_norm(b.op("Reshape", x, b.const([0, 0, n, hd])), wname)
        return b.op("Reshape", y, b.const([0, 0, n * hd]))

    def attention(i, x):
        p = f"model.layers.{i}.self_attn"
        ltype = cfg.layer_types[i]
        past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        pres_k, pres_v = f"present.{i}.key", f"present.{i}.value"
        if flavour == "ort" and not arch.qk_norm:
            # One packed QKV MatMul; GroupQueryAttention unpacks it.
            q = project(x, [p + ".q_proj", p + ".k_proj", p + ".v_proj"], p + ".qkv_proj.weight")
            k = v = ""
        else:
            q, k, v = (linear(x, f"{p}.{n}_proj") for n in "qkv")
            if arch.qk_norm:
                q, k = head_norm(q, nh, p + ".q_norm.weight"), head_norm(k, kvh, p + ".k_norm.weight")
        if flavour == "ort":
            cos, sin = rope[ltype]
            out = b.op(
                "GroupQueryAttention",
                q,
                k,
                v,
                past_k,
                past_v,
                seqlens_k,
                total32,
                cos,
                sin,
                "position_ids",
                biases[ltype],
                domain="com.microsoft",
                outputs=3,
                num_heads=nh,
                kv_num_heads=kvh,
                scale=cfg.attn_scale,
                do_rotary=1,
                rotary_interleaved=0,
            )
            b.rename_output(out[1], pres_k)
            b.rename_output(out[2], pres_v)
            attn = out[0]
        else:
            cos, sin = rope[ltype]
            qh = rotate(heads(q, nh), cos, sin)  # [B, nh, S, hd]
            kh = rotate(heads(k, kvh), cos, sin)  # [B, kvh, S, hd]
            vh = heads(v, kvh)
            idx = b.op("Expand", slots, b.op("Shape", kh))
            new_k = b.rename_output(b.op("ScatterElements", past_k, idx, kh, axis=2), pres_k)
            new_v = b.rename_output(b.op("ScatterElements", past_v, idx, vh, axis=2), pres_v)
            keys = b.op("Slice", new_k, b.const([0]), b.op("Unsqueeze", total, b.const([0])), b.const([2]))
            vals = b.op("Slice", new_v, b.const([0]), b.op("Unsqueeze", total, b.const([0])), b.const([2]))
            g = nh // kvh
            # Group query heads by their KV head: [B, kvh, g*S, hd] @ [B, kvh, hd, T] -> [B, kvh, g*S, T]
            qg = b.op("Reshape", qh, b.const([0, kvh, -1, hd]))
            scores = b.op(
                "Mul", b.op("MatMul", qg, b.op("Transpose", keys, perm=[0, 1, 3, 2])), b.const(cfg.attn_scale, wdt)
            )
            scores = b.op(
                "Reshape",
                scores,
                b.op("Concat", b.const([0, kvh, g, -1]), b.op("Unsqueeze", total, b.const([0])), axis=0),
            )
            scores = b.op("Add", scores, b.op("Unsqueeze", biases[ltype], b.const([2])))  # bias [B,1,1,S,T]
            probs = b.op("Softmax", scores, axis=-1)
            grouped = b.op("Concat", b.const([0, kvh, -1]), b.op("Unsqueeze", total, b.const([0])), axis=0)
            ctx = b.op("MatMul", b.op("Reshape", probs, grouped), vals)  # [B, kvh, g*S, hd]
            ctx = b.op("Reshape", ctx, b.const([0, nh, -1, hd]))  # [B, nh, S, hd]
            attn = b.op("Reshape", b.op("Transpose", ctx, perm=[0, 2, 1, 3]), b.const([0, 0, nh * hd]))
        return linear(attn, p + ".o_proj")

    def mlp(i, x):
        p = f"model.layers.{i}.mlp"
        # One MatMul for gate and up (half the kernel launches), split after.
        inter = w[p + ".gate_proj.weight"].shape[0]
        gate_up = project(x, [p + ".gate_proj", p + ".up_proj"], p + ".gate_up_proj.weight")
        gate, up = b.op("Split", gate_up, b.const([inter, inter]), axis=-1, outputs=2)
        return linear(b.op("Mul", activation(gate), up), p + ".down_proj")

    def add_norm(x, h, wname):
        """(x + h, rms_norm(x + h)): one fused SkipSimplifiedLayerNormalization on the ort flavour."""
        if flavour == "ort":
            out = b.op(
                "SkipSimplifiedLayerNormalization",
                h,
                x,
                norm_weight(wname),
                domain="com.microsoft",
                outputs=4,
                epsilon=cfg.rms_eps,
            )
            return out[3], out[0]
        x = b.op("Add", x, h)
        return x, rms_norm(x, wname)

    # ---- the decoder
    embed = w["model.embed_tokens.weight"]
    tied = "lm_head.weight" not in w or np.array_equal(w["lm_head.weight"], embed)
    table = "model.embed_tokens.weight"
    shared = tied_weights(embed, qmap.get(table), dtype) if tied else None
    if isinstance(shared, (BlockQuantized, ChannelQuantized)):  # one quantized table, also the LM head (below)
        x = quantized_rows("input_ids", table, shared)  # a GGUF's own blocks or int8 rows, dequantized as gathered
    else:  # a float table: the embedding's own, or (shared == "float") the LM head's too
        x = b.op("Gather", b.init(table, embed.astype(wdt)), "input_ids", axis=0)
    if arch.embed_scale:
        x = b.op("Mul", x, b.const(np.sqrt(H), wdt))
    normed = rms_norm(x, "model.layers.0.input_layernorm.weight")
    entering = {}  # layer -> the residual stream entering it, for ``feature_layers``
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        entering[i] = x
        h = attention(i, normed)
        if arch.sandwich_norm:
            h = rms_norm(h, p + ".post_attention_layernorm.weight")
            x, normed = add_norm(x, h, p + ".pre_feedforward_layernorm.weight")
            h = rms_norm(mlp(i, normed), p + ".post_feedforward_layernorm.weight")
        else:
            x, normed = add_norm(x, h, p + ".post_attention_layernorm.weight")
            h = mlp(i, normed)
        nxt = f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < cfg.num_layers else "model.norm.weight"
        x, normed = add_norm(x, h, nxt)  # the residual stream, and the next layer's (or the final) norm of it
    x = normed
    last = b.op("Slice", x, b.op("Neg", "logits_to_keep"), b.const([np.iinfo(np.int64).max]), b.const([1]))
    if shared is None and tied:  # two tables: the head is quantized from the float embedding (see tied_weights)
        w["lm_head.weight"] = embed
        if table in qmap:
            qmap.setdefault("lm_head.weight", qmap[table])
    if shared is None:
        logits = linear(last, "lm_head")
    elif isinstance(shared, str):  # "float": ONNX Runtime folds the Transpose once at session start (not on disk)
        logits = b.op("MatMul", last, b.op("Transpose", table, perm=[1, 0]))
    else:
        logits = quantized_matmul(last, table, shared)
    if cfg.final_logit_softcap:
        cap = b.const(cfg.final_logit_softcap, wdt)
        logits = b.op("Mul", b.op("Tanh", b.op("Div", logits, cap)), cap)
    if wdt == np.float16:
        logits = b.op("Cast", logits, to=TensorProto.FLOAT)
        x = b.op("Cast", x, to=TensorProto.FLOAT)
    b.rename_output(logits, "logits")
    b.outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "kept", cfg.vocab_size]))
    for i in range(cfg.num_layers):
        for kind in ("key", "value"):
            b.outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", elem, ["batch", kvh, capacity, hd]))
    if hidden_states:
        b.rename_output(x, "hidden_states")
        b.outputs.append(helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, ["batch", "seq", H]))
    if feature_layers:
        if not set(feature_layers) <= set(entering):
            raise ValueError(f"feature layers {list(feature_layers)} outside 0..{cfg.num_layers - 1}")
        taps = [entering[k] for k in feature_layers]
        feats = b.op("Concat", *taps, axis=-1) if len(taps) > 1 else taps[0]
        if wdt == np.float16:
            feats = b.op("Cast", feats, to=TensorProto.FLOAT)
        b.rename_output(feats, "layer_features")
        width = len(taps) * H
        b.outputs.append(helper.make_tensor_value_info("layer_features", TensorProto.FLOAT, ["batch", "seq", width]))

    graph = helper.make_graph(b.nodes, "specdec_edge_decoder", b.inputs, b.outputs, initializer=b.inits)
    opsets = [helper.make_opsetid("", OPSET)]
    if flavour == "ort":
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="specdec-edge")
    model.ir_version = IR_VERSION
    return model


def tied_weights(embed: np.ndarray, own: BlockQuantized | None, dtype: str):
    """How a tied model (LM head == embedding) stores its one table: "float" (an fp32/fp16 table), a quantized
    form that both the Gather and the LM head read, or None (two tables: a float embedding beside the head's).

    * fp32/fp16 (and a GGUF whose table is stored as floats): one float table, values unchanged.
    * a GGUF's own blocks (``own``, ``--dtype gguf``): the blocks; the embedding dequantizes the rows it
      gathers, the same values transformers dequantized, so the graph computes what it did with two tables.
    * int8 / int4: the head's quantized table; the embedding's rows then carry the head's rounding too
      (before: exact fp32 rows). Greedy agreement with fp32 did not drop on SmolLM2 (docs/PERFORMANCE.md,
      "Tied embeddings stored once"), and the bundle loses the fp32 copy (113 MB there, 671 MB for Gemma 3).
    """
    if own is not None:
        return own if len(np.unique(own.zero)) == 1 else None  # the Gather reads one zero point per tensor
    if dtype in ("fp32", "fp16", "gguf"):  # "gguf" without own blocks: the file stores the table as floats
        return "float"
    return quantize_channels(embed) if dtype == "int8" else quantize_blocks(embed)


def save(model: onnx.ModelProto, path) -> None:
    """Save with all weights in one external file ``<name>.data`` beside the graph."""
    from pathlib import Path

    model.ir_version = min(model.ir_version, IR_VERSION)
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=Path(path).name + ".data",
        size_threshold=1024,
    )
