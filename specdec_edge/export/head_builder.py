"""The EAGLE and EAGLE-3 head step graphs, built op by op from a head's weights (not traced from torch).

A head step runs several times per target pass (once per tree depth), so its graph must cost little beside the
target's: the graph traced from torch was ~220 nodes around fp32 MatMuls, ~0.7-1 ms a step on 2 CPU cores where the
target's one-row pass takes ~5 ms; this one takes about half (docs/lab/heads.md, "A cheaper head step"). Built:

* every linear layer (``fc``, q/k/v as one, ``o_proj``, gate/up as one, ``down_proj``, the LM head) as 8-bit
  blocks of 32 along the input (``com.microsoft.MatMulNBits``, int8 activations: ``linears.ACCURACY_LEVEL``),
  where the input size is a multiple of the block; else fp32. The attention scale is folded into q's weights;
* rotary by ``com.microsoft.RotaryEmbedding`` over the cos/sin of the step's own positions (a table per step, so no
  capacity bounds the positions); RMS norms as ONNX Runtime's fused (Skip)SimplifiedLayerNormalization;
* attention in plain ops over the host's cache ``[1, P, kvh, hd]`` and the new rows, each KV head's query heads
  broadcast over it (no copy per query head); the top-k of the LM head's log-softmax.

The inputs and outputs are the recipe's (``head_recipes.py``; docs/DESIGN.md has the table) and so is what it
computes: the recipe's torch wrapper (``head_onnx.EagleGraph``, ``Eagle3Graph``), against which ``head_export``
validates it. ``bits=None`` keeps every layer fp32 (tests check the structure at fp32 rounding that way).
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from specdec_edge.export.graph import IR_VERSION, OPSET, Builder
from specdec_edge.export.head_onnx import TOP_K
from specdec_edge.export.linears import Linears
from specdec_edge.export.quant_weights import quantize_blocks

# The head's linear layers: 8-bit blocks of 32 propose the fp32 head's top-1 on 98-99 % of real rows; 4 bits were
# ~1.4x faster still but agreed on 72 %, blocks of 64 on 96.6 % (docs/lab/heads.md).
WEIGHT_BITS = 8
WEIGHT_BLOCK = 32
# The built graph vs its torch module (relative to each output's scale): 8-bit weights and int8 activations move
# the outputs by ~1e-2 (fp32 graphs: head_export.TOLERANCE); the manifest records the measured error and agreement.
QUANTIZED_TOLERANCE = 5e-2
EMBED = "target.embed"


def build_head_graph(head, bits: int | None = WEIGHT_BITS, table: dict | None = None) -> onnx.ModelProto:
    """The step graph of an EAGLE or EAGLE-3 ``head`` (``head_modules``), its linear layers as ``bits``-bit blocks
    (None: fp32). ``table``: where the target graph keeps its float embedding table (``head_export.float_table``);
    the graph then reads those bytes (it must be saved beside the target graph), else it holds the head's copy."""
    step = HeadStep(head, bits, table)
    step.declare_io()
    if head.cfg.method == "eagle3":
        hidden = step.b.op("Concat", step.lin.linear("target_features", "fc"), "features", axis=1)  # [1, S, H]
        normed = (step.norm(step.embed(), "input_norm"), step.norm(hidden, "hidden_norm"))
        x = step.b.op("Concat", *normed, axis=-1)  # [1, S, 2H]
    else:
        hidden = step.lin.linear(step.b.op("Concat", step.embed(), "features", axis=-1), "fc")  # [1, S, H]
        x = step.norm(hidden, "input_norm")
    out = step.named(step.finish(hidden, step.attention(x)), "hidden_states")  # [1, S, H]
    step.top_k(out, "norm" if head.cfg.method == "eagle3" else None)
    return step.model()


class HeadStep:
    """One head step graph under construction: its ``Builder``, the head's weights and their ``Linears``."""

    def __init__(self, head, bits: int | None, table: dict | None):
        self.head, self.cfg, self.table = head, head.cfg, table
        self.b = Builder()
        weights = {n + ".weight": _array(getattr(head, n).weight) for n in _LINEARS}
        weights["q_proj.weight"] = weights["q_proj.weight"] * np.float32(self.cfg.head_dim**-0.5)  # softmax's scale
        lm_head = head.lm_head if self.cfg.method == "eagle3" else head.target.lm_head_t.T  # [V', H]
        weights["lm_head.weight"] = np.ascontiguousarray(_array(lm_head))
        forms = {}
        if bits is not None:
            forms = {
                n: quantize_blocks(w, bits, WEIGHT_BLOCK) for n, w in weights.items() if not w.shape[1] % WEIGHT_BLOCK
            }
        self.lin = Linears(self.b, weights, forms, "fp32", np.dtype(np.float32))

    def declare_io(self) -> None:
        """The recipe's inputs and outputs, with the manifest's sizes fixed (``runtime.head_graphs.SHAPES``)."""
        cfg, f, i64 = self.cfg, TensorProto.FLOAT, TensorProto.INT64
        cache = [1, "past", cfg.num_kv_heads, cfg.head_dim]
        new = [1, "seq", cfg.num_kv_heads, cfg.head_dim]
        inputs = [("features", f, [1, "seq", cfg.hidden_size])]
        if cfg.method == "eagle3":
            width = len(cfg.feature_layers) * cfg.hidden_size
            inputs = [("target_features", f, [1, "committed", width]), ("features", f, [1, "drafted", cfg.hidden_size])]
        inputs += [("input_ids", i64, [1, "seq"]), ("position_ids", i64, [1, "seq"]), ("past_key", f, cache),
                   ("past_value", f, cache), ("attention_bias", f, [1, 1, "seq", "total"]),
                   ("logit_rows", i64, ["rows"])]  # fmt: skip
        outputs = [("hidden_states", f, [1, "seq", cfg.hidden_size]), ("topk_logprobs", f, ["rows", TOP_K]),
                   ("topk_ids", i64, ["rows", TOP_K]), ("key", f, new), ("value", f, new)]  # fmt: skip
        self.b.inputs += [helper.make_tensor_value_info(*i) for i in inputs]
        self.b.outputs += [helper.make_tensor_value_info(*o) for o in outputs]

    def embed(self) -> str:
        """The target's embedding of ``input_ids`` [1, S] -> [1, S, H] fp32."""
        b, table = self.b, self.table
        if table is None:
            name = b.init(EMBED, self.head.target.embed.numpy())
        else:  # the target graph's bytes, in its data file (this graph is saved beside it)
            init = TensorProto(name=EMBED, data_type=table["data_type"], dims=table["dims"])
            init.data_location = TensorProto.EXTERNAL
            for key in ("location", "offset", "length"):
                init.external_data.add(key=key, value=str(table[key]))
            b.inits.append(init)
            name = EMBED
        rows = b.op("Gather", name, "input_ids", axis=0)
        return rows if self.head.target.embed.dtype == torch.float32 else b.op("Cast", rows, to=TensorProto.FLOAT)

    def norm(self, x: str, name: str) -> str:
        """RMSNorm of x [..., H] by the head's weight ``name`` (fp32 statistics)."""
        weight = self.b.init(name, _array(getattr(self.head, name)))
        return self.b.op("SimplifiedLayerNormalization", x, weight, axis=-1, epsilon=self.cfg.rms_eps, stash_type=1)

    def rotary(self) -> tuple[str, str, str]:
        """cos and sin [S, hd/2] of the step's positions, and the position offset 0 that indexes them row by row."""
        b, hd = self.b, self.cfg.head_dim
        inv = 1.0 / self.cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)  # as head_modules.rotate
        angles = b.op("Mul", b.op("Cast", b.op("Reshape", "position_ids", b.const([-1, 1])), to=TensorProto.FLOAT),
                      b.const(inv.astype(np.float32), np.float32))  # fmt: skip
        return b.op("Cos", angles), b.op("Sin", angles), b.const([0])

    def attention(self, x: str) -> str:
        """Grouped-query attention of x [1, S, D] (normed) over the cache and the new rows -> [1, S, nh*hd]; writes
        the ``key`` and ``value`` outputs [1, S, kvh, hd] (rotated keys)."""
        b, cfg = self.b, self.cfg
        nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.lin.project(x, ["q_proj", "k_proj", "v_proj"], "qkv_proj.weight")
        q, k, v = b.op("Split", qkv, b.const([nh * hd, kvh * hd, kvh * hd]), axis=-1, outputs=3)
        cos, sin, offset = self.rotary()
        q, k = (b.op("RotaryEmbedding", t, offset, cos, sin, domain="com.microsoft", num_heads=n, interleaved=0)
                for t, n in ((q, nh), (k, kvh)))  # fmt: skip
        key = self.named(b.op("Reshape", k, b.const([0, 0, kvh, hd])), "key")  # [1, S, kvh, hd]
        value = self.named(b.op("Reshape", v, b.const([0, 0, kvh, hd])), "value")
        keys = b.op("Concat", "past_key", key, axis=1)  # [1, T, kvh, hd]
        values = b.op("Concat", "past_value", value, axis=1)
        keys = b.op("Unsqueeze", b.op("Transpose", keys, perm=[0, 2, 3, 1]), b.const([2]))  # [1, kvh, 1, hd, T]
        values = b.op("Unsqueeze", b.op("Transpose", values, perm=[0, 2, 1, 3]), b.const([2]))  # [1, kvh, 1, T, hd]
        q = b.op("Transpose", b.op("Reshape", q, b.const([0, 0, kvh, nh // kvh, hd])), perm=[0, 2, 3, 1, 4])
        scores = b.op("Add", b.op("MatMul", q, keys), "attention_bias")  # [1, kvh, g, S, T] (scaled in q's weights)
        ctx = b.op("MatMul", b.op("Softmax", scores, axis=-1), values)  # [1, kvh, g, S, hd]
        return b.op("Reshape", b.op("Transpose", ctx, perm=[0, 3, 1, 2, 4]), b.const([0, 0, nh * hd]))

    def finish(self, hidden: str, attn: str) -> str:
        """The layer's output [1, S, H]: hidden + o_proj(attn), then its gated MLP over the post-attention norm."""
        b = self.b
        normed, _, _, x = b.op(
            "SkipSimplifiedLayerNormalization", self.lin.linear(attn, "o_proj"), hidden,
            b.init("post_norm", _array(self.head.post_norm)), domain="com.microsoft", outputs=4,
            epsilon=self.cfg.rms_eps,
        )  # fmt: skip
        inter = self.cfg.intermediate_size
        gate_up = self.lin.project(normed, ["gate_proj", "up_proj"], "gate_up_proj.weight")
        gate, up = b.op("Split", gate_up, b.const([inter, inter]), axis=-1, outputs=2)  # [1, S, I] each
        mlp = self.lin.linear(b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up), "down_proj")
        return b.op("Add", x, mlp)

    def top_k(self, out: str, norm: str | None) -> None:
        """``topk_logprobs`` and ``topk_ids`` [R, TOP_K] of the rows ``logit_rows`` of out [1, S, H] (EAGLE-3 normed
        by its own final ``norm`` first); ids of the full vocabulary."""
        b = self.b
        rows = b.op("Gather", b.op("Squeeze", out, b.const([0])), "logit_rows", axis=0)  # [R, H]
        if norm:
            rows = self.norm(rows, norm)
        logp = b.op("LogSoftmax", self.lin.linear(rows, "lm_head"), axis=-1)  # [R, V']
        values, idx = b.op("TopK", logp, b.const([TOP_K]), axis=-1, outputs=2)
        self.named(values, "topk_logprobs")
        vocab_ids = b.init("vocab_ids", self.head.target.vocab_ids.numpy())
        self.named(b.op("Gather", vocab_ids, idx, axis=0), "topk_ids")

    def named(self, value: str, name: str) -> str:
        """Name ``value``, an output of the node just added, as the graph output ``name`` (no Identity node)."""
        node = self.b.nodes[-1]
        node.output[list(node.output).index(value)] = name
        return name

    def model(self) -> onnx.ModelProto:
        b = self.b
        graph = helper.make_graph(b.nodes, f"specdec_edge_{self.cfg.method}_head", b.inputs, b.outputs, b.inits)
        opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="specdec-edge")
        model.ir_version = IR_VERSION
        return model


_LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _array(t) -> np.ndarray:
    return t.detach().float().numpy()
