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

The residual stream (embeddings, each layer's sums, the norms over it) is fp32 in every graph, fp16 ones included:
only the linear layers, attention and the MLP run in fp16 there. Gemma 3's stream outgrows fp16 (65,504): measured
on Gemma-3-270M, past it at the ``<bos>`` token of real text (up to 1.0e5), then inf, then NaN (docs/lab/exactness.md,
"Gemma-3 fp16").

Layout: ``build_decoder`` runs the steps of a ``DecoderGraph`` (inputs, masks, embedding, layers, tied head,
outputs); ``OrtAttention`` and ``PortableAttention`` are the two attention flavours; the linear layers
(float, int8, 4-bit and GGUF blocks) and quantized gathers are ``export.linears.Linears``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specdec_edge.export.arch import ArchSpec
from specdec_edge.export.linears import Linears
from specdec_edge.export.quant_weights import (
    BlockQuantized,
    ChannelQuantized,
    quantize_blocks,
    quantize_channels,
)
from specdec_edge.runtime.base import ATTENTION_ROWS_KEY

OPSET = 17
IR_VERSION = 10  # ONNX Runtime 1.32 reads IR <= 13; onnx 1.23 would write 14.
# The ``ort`` flavour's attention op sees at least this many rows (``OrtAttention.pad_rows``): a one-row pass pads
# only attention, whose one-row path rounds unlike its several-row one on the CPUs measured (docs/PERFORMANCE.md).
# Written into the graph's metadata under ATTENTION_ROWS_KEY (the runtime reads it to name the verdict's form).
ATTENTION_ROWS = 2
NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


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
    sliding_window: int | None  # keys the "sliding_attention" layers attend within; None: no mask (all of them)
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
    Norms, the embedding table and the cache stay fp32 (fp16 for "fp16", except the residual stream and its norms,
    fp32 in every graph: ``DecoderGraph.to_stream``).

    A tied model (LM head == embedding) stores the table once (``tied_weights``): the embedding
    Gather and the LM head read the same initializer(s).
    """
    if flavour not in ("ort", "portable"):
        raise ValueError(f"unknown flavour {flavour}")
    if not set(feature_layers) <= set(range(cfg.num_layers)):
        raise ValueError(f"feature layers {list(feature_layers)} outside 0..{cfg.num_layers - 1}")
    g = DecoderGraph(cfg, flavour, dtype, capacity)
    g.declare_inputs()
    g.masks()
    g.attend = (OrtAttention if flavour == "ort" else PortableAttention)(g)
    x, entering = g.decoder_layers(g.embed())  # [B, S, H] after the final norm; the streams entering each layer
    logits = g.lm_head(x)  # [B, kept, V]
    g.declare_outputs(logits, x, hidden_states, [entering[k] for k in feature_layers])
    return g.model()


EMBED = "model.embed_tokens.weight"


class DecoderGraph:
    """One decoder graph under construction: its ``Builder``, the config, the linear layers and the per-step
    values every layer reads (attention biases, the bias width). ``build_decoder`` calls the steps in order;
    each step emits its nodes in a fixed order, so a config always gives the same bytes."""

    def __init__(self, cfg: DecoderConfig, flavour: str, dtype: str, capacity: int):
        self.cfg, self.arch, self.flavour, self.dtype, self.capacity = cfg, cfg.arch, flavour, dtype, capacity
        self.wdt = np.dtype(np.float16 if dtype == "fp16" else np.float32)
        self.elem = NP_TO_ONNX[self.wdt]
        self.half = self.wdt == np.float16  # fp16 weights; the residual stream stays fp32 (to_stream, to_weights)
        self.b = Builder()
        self.weights = dict(cfg.weights)  # local: the LM head of a tied model stored twice is added (lm_head)
        self.linears = Linears(self.b, self.weights, dict(cfg.quantized), dtype, self.wdt)
        embed = self.weights[EMBED]
        self.tied = "lm_head.weight" not in self.weights or np.array_equal(self.weights["lm_head.weight"], embed)
        # how the tied table is stored: "float", one quantized form, or None (two tables; see tied_weights)
        self.shared = tied_weights(embed, self.linears.forms.get(EMBED), dtype) if self.tied else None
        self.attend = None  # OrtAttention | PortableAttention, set once the masks exist
        self.total = self.seq = None  # int64 scalars: the bias width (past + S), S
        self.biases: dict = {}  # layer type -> attention bias [B, 1, S, T] in the weights' float type

    def fconst(self, value) -> str:
        """A constant in the weights' float type."""
        return self.b.const(value, self.wdt)

    def to_stream(self, h: str) -> str:
        """A value in the weights' float type (a sublayer's output, an embedding row) -> the residual stream's fp32.

        In fp16 graphs the stream is kept fp32: Gemma 3's outgrows fp16's 65,504 (inf, then NaN after the next
        norm, and GroupQueryAttention's probabilities x values then spread the NaN to every row of the pass)."""
        return self.b.op("Cast", h, to=TensorProto.FLOAT) if self.half else h

    def to_weights(self, x: str) -> str:
        """A stream value (fp32) -> the weights' float type, as a linear layer reads it."""
        return self.b.op("Cast", x, to=self.elem) if self.half else x

    # ---- I/O declarations
    def declare_inputs(self) -> None:
        cfg, b = self.cfg, self.b
        b.inputs += [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_bias", TensorProto.FLOAT, ["batch", 1, "seq", "total"]),
            # logits only for the last N new positions (prefill needs 1; verification needs all S)
            helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, [1]),
        ]
        b.inputs += [
            helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", self.elem, self.cache_shape)
            for i in range(cfg.num_layers)
            for kind in ("key", "value")
        ]

    @property
    def cache_shape(self) -> list:
        return ["batch", self.cfg.num_kv_heads, self.capacity, self.cfg.head_dim]

    def declare_outputs(self, logits: str, x: str, hidden_states: bool, taps: list[str]) -> None:
        """Outputs: logits [B, kept, V], present.{i}.key/value, hidden states x [B, S, H] if ``hidden_states``,
        layer features (``taps`` [B, S, H] each, concatenated) if any; all float32 (x and the taps: stream values)."""
        b, cfg = self.b, self.cfg
        if self.half:
            logits = b.op("Cast", logits, to=TensorProto.FLOAT)
        self._output(logits, "logits", ["batch", "kept", cfg.vocab_size])
        b.outputs += [
            helper.make_tensor_value_info(f"present.{i}.{kind}", self.elem, self.cache_shape)
            for i in range(cfg.num_layers)
            for kind in ("key", "value")
        ]
        if hidden_states:
            self._output(x, "hidden_states", ["batch", "seq", cfg.hidden_size])
        if taps:
            self._output(self.features(taps), "layer_features", ["batch", "seq", len(taps) * cfg.hidden_size])

    def _output(self, value: str, name: str, shape: list) -> None:
        self.b.rename_output(value, name)
        self.b.outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))

    def model(self) -> onnx.ModelProto:
        b = self.b
        graph = helper.make_graph(b.nodes, "specdec_edge_decoder", b.inputs, b.outputs, initializer=b.inits)
        opsets = [helper.make_opsetid("", OPSET)]
        if self.flavour == "ort":
            opsets.append(helper.make_opsetid("com.microsoft", 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="specdec-edge")
        model.ir_version = IR_VERSION
        if self.flavour == "ort":
            helper.set_model_props(model, {ATTENTION_ROWS_KEY: str(ATTENTION_ROWS)})
        return model

    # ---- feature taps
    def features(self, taps: list[str]) -> str:
        """The residual streams entering the feature layers, [B, S, H] fp32 each -> [B, S, n*H] float32."""
        return self.b.op("Concat", *taps, axis=-1) if len(taps) > 1 else taps[0]

    # ---- per-step values
    def masks(self) -> None:
        """The bias width ``total`` (past + S), ``seq`` (S), and each layer type's attention bias [B, 1, S, T]."""
        b, cfg = self.b, self.cfg
        bias = b.op("Cast", "attention_bias", to=self.elem) if self.wdt == np.float16 else "attention_bias"
        bias_shape = b.op("Shape", "attention_bias")
        self.total = b.op("Gather", bias_shape, b.const(3), axis=0)  # int64 scalar: past + S
        self.seq = b.op("Gather", b.op("Shape", "input_ids"), b.const(1), axis=0)
        self.biases = {"full_attention": bias, "sliding_attention": bias}
        if cfg.sliding_window is not None and "sliding_attention" in cfg.layer_types:
            # Local layers also mask keys at distance >= window from the query position.
            kpos = b.op("Range", b.const(0), self.total, b.const(1))  # [T]
            qpos = b.op("Unsqueeze", "position_ids", b.const([1, 3]))  # [B, 1, S, 1]
            far = b.op("GreaterOrEqual", b.op("Sub", qpos, kpos), b.const(cfg.sliding_window))
            self.biases["sliding_attention"] = b.op("Where", far, self.fconst(-np.inf), bias)

    # ---- embedding and tied head
    def embed(self) -> str:
        """Token embeddings [B, S, H] fp32 (the stream): a float table's rows, or a shared quantized table's rows
        dequantized."""
        b = self.b
        if isinstance(self.shared, (BlockQuantized, ChannelQuantized)):  # one quantized table, also the LM head
            x = self.linears.rows("input_ids", EMBED, self.shared)  # a GGUF's own blocks or int8 rows
        else:  # a float table: the embedding's own, or (shared == "float") the LM head's too
            x = self.to_stream(b.op("Gather", b.init(EMBED, self.weights[EMBED].astype(self.wdt)), "input_ids", axis=0))
        if self.arch.embed_scale:
            x = b.op("Mul", x, b.const(np.sqrt(self.cfg.hidden_size), np.float32))
        return x

    def lm_head(self, x: str) -> str:
        """Logits [B, kept, V] of the last ``logits_to_keep`` rows of x [B, S, H] fp32, soft-capped if the model is."""
        b, cfg = self.b, self.cfg
        last = b.op("Slice", x, b.op("Neg", "logits_to_keep"), b.const([np.iinfo(np.int64).max]), b.const([1]))
        last = self.to_weights(last)
        if self.shared is None and self.tied:  # two tables: the head is quantized from the float embedding
            self.weights["lm_head.weight"] = self.weights[EMBED]
            if EMBED in self.linears.forms:
                self.linears.forms.setdefault("lm_head.weight", self.linears.forms[EMBED])
        if self.shared is None:
            logits = self.linears.linear(last, "lm_head")
        elif isinstance(self.shared, str):  # "float": ONNX Runtime folds the Transpose once at session start
            logits = b.op("MatMul", last, b.op("Transpose", EMBED, perm=[1, 0]))
        else:
            logits = self.linears.matmul(last, EMBED, self.shared)
        if cfg.final_logit_softcap:
            cap = self.fconst(cfg.final_logit_softcap)
            logits = b.op("Mul", b.op("Tanh", b.op("Div", logits, cap)), cap)
        return logits

    # ---- norms
    def norm_weight(self, name: str, dtype=np.float32) -> str:
        return self.b.init(name, (self.weights[name] + self.arch.norm_offset).astype(dtype))

    def rms_norm(self, x: str, wname: str, *, stream: bool = True) -> str:
        """RMSNorm over the last axis of x [..., H], fp32 statistics. ``stream``: x, the weight and the result
        are fp32 (the residual stream's norms); else in the weights' float type (the per-head q/k norms)."""
        b = self.b
        dtype = np.float32 if stream else self.wdt
        if self.flavour == "ort":
            return b.op(
                "SimplifiedLayerNormalization",
                x,
                self.norm_weight(wname, dtype),
                axis=-1,
                epsilon=self.cfg.rms_eps,
                stash_type=1,
            )
        half = self.half and not stream
        xf = b.op("Cast", x, to=TensorProto.FLOAT) if half else x
        ms = b.op("ReduceMean", b.op("Mul", xf, xf), axes=[-1], keepdims=1)
        inv = b.op("Reciprocal", b.op("Sqrt", b.op("Add", ms, b.const(self.cfg.rms_eps, np.float32))))
        y = b.op("Mul", xf, inv)
        if half:
            y = b.op("Cast", y, to=self.elem)
        return b.op("Mul", y, self.norm_weight(wname, dtype))

    def add_norm(self, x: str, h: str, wname: str) -> tuple[str, str]:
        """(x + h, rms_norm(x + h)), x and h [B, S, H] fp32 (stream values): one fused SkipSimplifiedLayerNormalization
        on ``ort``."""
        if self.flavour == "ort":
            out = self.b.op(
                "SkipSimplifiedLayerNormalization",
                h,
                x,
                self.norm_weight(wname),  # fp32: the stream's
                domain="com.microsoft",
                outputs=4,
                epsilon=self.cfg.rms_eps,
            )
            return out[3], out[0]
        x = self.b.op("Add", x, h)
        return x, self.rms_norm(x, wname)

    def head_norm(self, x: str, n: int, wname: str) -> str:
        """Per-head RMSNorm of x [B, S, n*hd]."""
        hd = self.cfg.head_dim
        y = self.rms_norm(self.b.op("Reshape", x, self.b.const([0, 0, n, hd])), wname, stream=False)  # [B, S, n, hd]
        return self.b.op("Reshape", y, self.b.const([0, 0, n * hd]))

    # ---- decoder layers
    def decoder_layers(self, x: str) -> tuple[str, dict]:
        """Every layer over the embeddings x [B, S, H] -> (the final norm of the residual stream [B, S, H],
        {layer: the residual stream entering it})."""
        n = self.cfg.num_layers
        normed = self.rms_norm(x, "model.layers.0.input_layernorm.weight")
        entering = {}
        for i in range(n):
            entering[i] = x
            nxt = f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < n else "model.norm.weight"
            x, normed = self.layer(i, x, normed, nxt)
        return normed, entering

    def layer(self, i: int, x: str, normed: str, next_norm: str) -> tuple[str, str]:
        """Layer i over the residual stream x [B, S, H] (``normed``: its input norm; both fp32) -> (the stream after
        the layer [B, S, H], its norm by ``next_norm``: the next layer's input norm, or the final norm)."""
        p = f"model.layers.{i}"
        h = self.to_stream(self.attention(i, self.to_weights(normed)))
        if self.arch.sandwich_norm:
            h = self.rms_norm(h, p + ".post_attention_layernorm.weight")
            x, normed = self.add_norm(x, h, p + ".pre_feedforward_layernorm.weight")
            h = self.to_stream(self.mlp(i, self.to_weights(normed)))
            h = self.rms_norm(h, p + ".post_feedforward_layernorm.weight")
        else:
            x, normed = self.add_norm(x, h, p + ".post_attention_layernorm.weight")
            h = self.to_stream(self.mlp(i, self.to_weights(normed)))
        return self.add_norm(x, h, next_norm)

    def attention(self, i: int, x: str) -> str:
        """Self-attention of layer i over x [B, S, H] (normed) -> [B, S, H]; writes ``present.{i}.key/value``."""
        p, cfg, lin = f"model.layers.{i}.self_attn", self.cfg, self.linears
        if self.attend.packs_qkv and not self.arch.qk_norm:
            # One packed QKV MatMul [B, S, (nh + 2 kvh) hd]; GroupQueryAttention unpacks it.
            q = lin.project(x, [p + ".q_proj", p + ".k_proj", p + ".v_proj"], p + ".qkv_proj.weight")
            k = v = ""
        else:
            q, k, v = (lin.linear(x, f"{p}.{n}_proj") for n in "qkv")  # [B, S, nh*hd], [B, S, kvh*hd] x2
            if self.arch.qk_norm:
                q = self.head_norm(q, cfg.num_heads, p + ".q_norm.weight")
                k = self.head_norm(k, cfg.num_kv_heads, p + ".k_norm.weight")
        attn = self.attend(i, q, k, v)  # [B, S, nh*hd]
        return lin.linear(attn, p + ".o_proj")

    # ---- MLP
    def mlp(self, i: int, x: str) -> str:
        """Gated MLP of layer i: x [B, S, H] -> [B, S, H]."""
        p = f"model.layers.{i}.mlp"
        # One MatMul for gate and up (half the kernel launches), split after.
        inter = self.weights[p + ".gate_proj.weight"].shape[0]
        gate_up = self.linears.project(x, [p + ".gate_proj", p + ".up_proj"], p + ".gate_up_proj.weight")
        gate, up = self.b.op("Split", gate_up, self.b.const([inter, inter]), axis=-1, outputs=2)  # [B, S, I] each
        return self.linears.linear(self.b.op("Mul", self.activation(gate), up), p + ".down_proj")

    def activation(self, x: str) -> str:
        b, c = self.b, self.fconst
        if self.arch.activation == "silu":
            return b.op("Mul", x, b.op("Sigmoid", x))
        # gelu with tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        inner = b.op(
            "Mul", b.op("Add", x, b.op("Mul", b.op("Mul", b.op("Mul", x, x), x), c(0.044715))), c(np.sqrt(2 / np.pi))
        )
        return b.op("Mul", b.op("Mul", x, c(0.5)), b.op("Add", b.op("Tanh", inner), c(1.0)))


class OrtAttention:
    """The ``ort`` flavour: ONNX Runtime's fused GroupQueryAttention, rotary inside, each layer's cache bound as
    input and output and written in place."""

    packs_qkv = True  # takes Q, K and V packed in one input

    def __init__(self, g: DecoderGraph):
        self.g = g
        b, cfg = g.b, g.cfg
        # GroupQueryAttention writes the new K/V at slots seqlens_k+1-S .. seqlens_k and attends up to seqlens_k.
        # seqlens_k is read from the bias's values, not its width: the last slot that some row attends to
        # (every new token attends to itself). So the bias may also span the whole capacity with later slots
        # masked, which gives every decode pass one shape (CUDA graphs: runtime/ort_gpu_engine.py).
        self.total32 = b.op("Cast", g.total, to=TensorProto.INT32)  # the bias width
        seen = b.op("ReduceMax", "attention_bias", axes=[1, 2], keepdims=0)  # [B, T]: 0 where some row attends
        slot_no = b.op(
            "Slice",
            b.const(np.arange(1, g.capacity + 1), np.float32),
            b.const([0]),
            b.op("Unsqueeze", g.total, b.const([0])),
        )  # [T]: 1 .. T
        attended = b.op("Where", b.op("Greater", seen, b.const(-np.inf, np.float32)), slot_no, b.const(0, np.float32))
        self.seqlens_k = b.op(  # [B] int32: the last attended slot
            "Cast",
            b.op("Sub", b.op("ReduceMax", attended, axes=[1], keepdims=0), b.const(1, np.float32)),
            to=TensorProto.INT32,
        )
        self.rope = {  # layer type -> cos, sin [capacity, hd / 2]
            t: (b.init(f"cos_cache.{t}", c.astype(g.wdt)), b.init(f"sin_cache.{t}", s.astype(g.wdt)))
            for t, (c, s) in cfg.rope.items()
        }
        self.pad_rows()

    def pad_rows(self) -> None:
        """The attention op's inputs of a pass of S < ATTENTION_ROWS rows, padded to ATTENTION_ROWS rows inside the
        graph, as ``runtime.base.pad_step`` pads a whole pass on the host: a padding row repeats the last row's
        q/k/v, position and mask, writes its K/V one slot after it (past the valid length, overwritten later; a
        column the real rows' masks hide) and no real row sees it. Only attention sees the extra row (``__call__``
        slices its output back to S rows), so a one-row pass runs every linear layer at one row: exact where the
        verdict measures a one-row pass of this graph equal to the first row of a two-row one
        (``runtime/verdicts.py``), else the engine pads the whole pass as before and ``pad`` is 0 here. Wider
        passes are unchanged (``pad`` 0)."""
        g, b = self.g, self.g.b
        pad = b.op("Max", b.op("Sub", b.const(ATTENTION_ROWS), g.seq), b.const(0))  # int64: max(0, 2 - S)
        pad1 = b.op("Unsqueeze", pad, b.const([0]))
        self.row_pads = b.op("Concat", b.const([0, 0, 0, 0]), pad1, b.const([0]), axis=0)  # [B, S, C] +pad rows
        pad32 = b.op("Cast", pad, to=TensorProto.INT32)
        self.seqlens_k = b.op("Add", self.seqlens_k, pad32)  # the last attended slot moves by the padding
        # the bias width: one more slot per padding row where the bias ends at the last new token (a bias as wide as
        # the cache already holds the slot)
        need = b.op("Add", b.op("ReduceMax", self.seqlens_k, keepdims=0), b.const(1, np.int32))
        total32 = b.op("Max", self.total32, need)
        extra = b.op("Unsqueeze", b.op("Cast", b.op("Sub", total32, self.total32), to=TensorProto.INT64), b.const([0]))
        self.total32 = total32
        zeros6 = b.const([0, 0, 0, 0, 0, 0])
        col_pads = b.op("Concat", zeros6, b.const([0]), extra, axis=0)  # [B, 1, S, T] +extra masked columns
        row_pads = b.op("Concat", zeros6, pad1, b.const([0]), axis=0)  # ... +pad rows (copies of the last)
        self.biases = {
            t: b.op("Pad", b.op("Pad", bias, col_pads, g.fconst(-np.inf)), row_pads, mode="edge")
            for t, bias in g.biases.items()
        }
        self.positions = b.op(
            "Pad", "position_ids", b.op("Concat", b.const([0, 0, 0]), pad1, axis=0), mode="edge"
        )  # [B, S + pad]
        self.rows = b.op("Unsqueeze", g.seq, b.const([0]))  # [1]: S, the rows sliced back after attention

    def __call__(self, i: int, q: str, k: str, v: str) -> str:
        """Layer i's attention: packed q [B, S, (nh + 2 kvh) hd] (k, v empty), or q, k, v -> [B, S, nh*hd]."""
        g, b = self.g, self.g.b
        ltype = g.cfg.layer_types[i]
        cos, sin = self.rope[ltype]
        q, k, v = (b.op("Pad", x, self.row_pads, mode="edge") if x else x for x in (q, k, v))  # [B, S + pad, ...]
        out = b.op(
            "GroupQueryAttention",
            q,
            k,
            v,
            f"past_key_values.{i}.key",
            f"past_key_values.{i}.value",
            self.seqlens_k,
            self.total32,
            cos,
            sin,
            self.positions,
            self.biases[ltype],
            domain="com.microsoft",
            outputs=3,
            num_heads=g.cfg.num_heads,
            kv_num_heads=g.cfg.num_kv_heads,
            scale=g.cfg.attn_scale,
            do_rotary=1,
            rotary_interleaved=0,
        )
        b.rename_output(out[1], f"present.{i}.key")
        b.rename_output(out[2], f"present.{i}.value")
        return b.op("Slice", out[0], b.const([0]), self.rows, b.const([1]))  # [B, S, nh*hd]


class PortableAttention:
    """The ``portable`` flavour: standard ONNX ops only. Rotary by Gather of cos/sin tables, ScatterElements of
    the new K/V into the fixed cache buffers, attention over the first ``past + S`` slots."""

    packs_qkv = False

    def __init__(self, g: DecoderGraph):
        self.g = g
        b = g.b
        self.rope = {}  # layer type -> cos, sin [B, 1, S, hd] at the tokens' positions
        for t, (c, s) in g.cfg.rope.items():
            cos = b.init(f"cos_table.{t}", np.concatenate([c, c], -1).astype(g.wdt))
            sin = b.init(f"sin_table.{t}", np.concatenate([s, s], -1).astype(g.wdt))
            self.rope[t] = tuple(
                b.op("Unsqueeze", b.op("Gather", tab, "position_ids", axis=0), b.const([1])) for tab in (cos, sin)
            )
        # cache slots of the new tokens: past .. past+S-1, shaped to broadcast over [B, kvh, S, hd]
        self.slots = b.op(
            "Reshape", b.op("Range", b.op("Sub", g.total, g.seq), g.total, b.const(1)), b.const([1, 1, -1, 1])
        )

    def heads(self, x: str, n: int) -> str:  # [B, S, n*hd] -> [B, n, S, hd]
        b = self.g.b
        return b.op("Transpose", b.op("Reshape", x, b.const([0, 0, n, self.g.cfg.head_dim])), perm=[0, 2, 1, 3])

    def rotate(self, x: str, cos: str, sin: str) -> str:  # x [B, n, S, hd]
        b, hd = self.g.b, self.g.cfg.head_dim
        x1, x2 = b.op("Split", x, b.const([hd // 2, hd // 2]), axis=-1, outputs=2)
        rot = b.op("Concat", b.op("Neg", x2), x1, axis=-1)
        return b.op("Add", b.op("Mul", x, cos), b.op("Mul", rot, sin))

    def width(self) -> str:  # [1]: T = past + S, for shapes and slices
        return self.g.b.op("Unsqueeze", self.g.total, self.g.b.const([0]))

    def write_cache(self, i: int, kh: str, vh: str) -> tuple[str, str]:
        """Scatter the new K/V [B, kvh, S, hd] into layer i's cache [B, kvh, capacity, hd] at slots
        past .. past+S-1 (``present`` = ``past`` updated); returns its first T slots, keys and values."""
        b = self.g.b
        idx = b.op("Expand", self.slots, b.op("Shape", kh))
        new = [
            b.rename_output(
                b.op("ScatterElements", f"past_key_values.{i}.{kind}", idx, h, axis=2), f"present.{i}.{kind}"
            )
            for kind, h in (("key", kh), ("value", vh))
        ]
        return tuple(b.op("Slice", c, b.const([0]), self.width(), b.const([2])) for c in new)  # [B, kvh, T, hd]

    def __call__(self, i: int, q: str, k: str, v: str) -> str:
        """Layer i's attention: q [B, S, nh*hd], k, v [B, S, kvh*hd] -> [B, S, nh*hd]."""
        g = self.g
        b, cfg = g.b, g.cfg
        nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        ltype = cfg.layer_types[i]
        cos, sin = self.rope[ltype]
        qh = self.rotate(self.heads(q, nh), cos, sin)  # [B, nh, S, hd]
        kh = self.rotate(self.heads(k, kvh), cos, sin)  # [B, kvh, S, hd]
        keys, vals = self.write_cache(i, kh, self.heads(v, kvh))  # [B, kvh, T, hd]
        # Group query heads by their KV head: [B, kvh, g*S, hd] @ [B, kvh, hd, T] -> [B, kvh, g*S, T]
        qg = b.op("Reshape", qh, b.const([0, kvh, -1, hd]))
        scores = b.op("Mul", b.op("MatMul", qg, b.op("Transpose", keys, perm=[0, 1, 3, 2])), g.fconst(cfg.attn_scale))
        by_group = b.op("Concat", b.const([0, kvh, nh // kvh, -1]), self.width(), axis=0)
        scores = b.op("Reshape", scores, by_group)  # [B, kvh, g, S, T]
        scores = b.op("Add", scores, b.op("Unsqueeze", g.biases[ltype], b.const([2])))  # bias [B, 1, 1, S, T]
        probs = b.op("Softmax", scores, axis=-1)
        grouped = b.op("Concat", b.const([0, kvh, -1]), self.width(), axis=0)
        ctx = b.op("MatMul", b.op("Reshape", probs, grouped), vals)  # [B, kvh, g*S, hd]
        ctx = b.op("Reshape", ctx, b.const([0, nh, -1, hd]))  # [B, nh, S, hd]
        return b.op("Reshape", b.op("Transpose", ctx, perm=[0, 2, 1, 3]), b.const([0, 0, nh * hd]))  # [B, S, nh*hd]


def tied_weights(embed: np.ndarray, own: BlockQuantized | None, dtype: str):
    """How a tied model (LM head == embedding) stores its one table: "float" (an fp32/fp16 table), a quantized
    form that both the Gather and the LM head read, or None (two tables: a float embedding beside the head's).

    * fp32/fp16 (and a GGUF whose table is stored as floats): one float table, values unchanged.
    * a GGUF's own blocks (``own``, ``--dtype gguf``): the blocks; the embedding dequantizes the rows it
      gathers, the same values transformers dequantized, so the graph computes what it did with two tables.
    * int8 / int4: the head's quantized table; the embedding's rows then carry the head's rounding too
      (before: exact fp32 rows). Greedy agreement with fp32 did not drop on SmolLM2 (docs/lab/export.md,
      "Tied embeddings stored once"), and the bundle loses the fp32 copy (113 MB there, 671 MB for Gemma 3).
    """
    if own is not None:
        return own if len(np.unique(own.zero)) == 1 else None  # the Gather reads one zero point per tensor
    if dtype in ("fp32", "fp16", "gguf"):  # "gguf" without own blocks: the file stores the table as floats
        return "float"
    return quantize_channels(embed) if dtype == "int8" else quantize_blocks(embed)


def save(model: onnx.ModelProto, path) -> None:
    """Save with all weights in one external file ``<name>.data`` beside the graph.

    The tensors are marked external here rather than by ``save_model(save_as_external_data=True)``: onnx
    1.23 refuses that when a file of the data file's name exists in the *current* directory (it checks the
    location relative to the working directory, not to the graph), so an export run from another bundle's
    folder failed. Same tensors, same order, same bytes."""
    import sys
    from pathlib import Path

    from onnx.external_data_helper import set_external_data

    model.ir_version = min(model.ir_version, IR_VERSION)
    location = Path(path).name + ".data"
    for tensor in _initializers(model.graph):
        if tensor.HasField("raw_data") and sys.getsizeof(tensor.raw_data) >= 1024:
            set_external_data(tensor, location)
    onnx.save_model(model, str(path))


def _initializers(graph: onnx.GraphProto):
    """Every initializer of ``graph`` and of its sub-graphs (what onnx converts to external data)."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _initializers(attr.g)
            for sub in attr.graphs:
                yield from _initializers(sub)
