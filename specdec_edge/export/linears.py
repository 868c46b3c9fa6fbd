"""The decoder graph's linear layers and quantized gathers, as ONNX ops (export/graph.py builds the rest).

A weight [N, K] is used in one of three forms:

* float (fp32 / fp16): ``MatMul`` with the transposed table stored;
* int8 per output channel (``ChannelQuantized``): each activation row quantized with its own scale, exact
  int32 sums (``MatMulInteger``), then column and row scales;
* 4-bit blocks or a GGUF's own blocks (``BlockQuantized``): ``MatMulNBits``, plus each block's minimum
  times its sum of activations where the blocks have minima (Q4_1, K-quants).

A quantized table's rows are also gathered and dequantized in the graph (the embedding of a tied model),
from the same initializers its MatMul reads.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from specdec_edge.export.quant_weights import (
    BlockQuantized,
    ChannelQuantized,
    quantize_blocks,
    quantize_channels,
)

# MatMulNBits compute: 4 = int8 activations (quantized per block of each row, like llama.cpp's Q8 dot
# products); 0/1 = fp32 activations, ~3x slower on this CPU (docs/lab/prefill-and-passes.md).
ACCURACY_LEVEL = 4


class Linears:
    """Linear layers of one graph under construction (``builder``, an ``export.graph.Builder``).

    ``weights``: HF names -> float32 arrays; ``forms``: names -> quantized forms used as they are (a GGUF's
    blocks); other weights follow ``dtype`` ("int8", "int4", else float ``wdt``). Both dicts are read when
    each layer is emitted, so a caller may add to them first (the LM head of a tied model)."""

    def __init__(self, builder, weights: dict, forms: dict, dtype: str, wdt: np.dtype):
        self.b, self.weights, self.forms, self.dtype, self.wdt = builder, weights, forms, dtype, wdt
        self._rows = {}  # activation -> (its rows as uint8 around 128, their scales [B, S, 1]): once per input
        self._stored = {}  # weight name -> its quantized initializers, written once (a tied table is read twice)

    def form(self, name: str):
        """The quantized form of weight ``name`` [N, K], or None to keep it float."""
        if name in self.forms:
            return self.forms[name]
        if self.dtype == "int4":
            return quantize_blocks(self.weights[name])
        if self.dtype == "int8":
            return quantize_channels(self.weights[name])
        return None

    def linear(self, x: str, prefix: str) -> str:
        """x [B, S, K] @ ``prefix``.weight.T (+ bias) -> [B, S, N]."""
        return self.project(x, [prefix])

    def project(self, x: str, prefixes: list[str], fused: str | None = None) -> str:
        """x [B, S, K] @ the weights of ``prefixes`` stacked along N -> [B, S, sum N], as one MatMul where they
        quantize alike (``fused`` names the stacked weight), plus their biases."""
        b, w = self.b, self.weights
        names = [p + ".weight" for p in prefixes]
        forms = [self.form(n) for n in names]
        name = fused or names[0]
        if all(f is None for f in forms):
            stacked = np.concatenate([w[n] for n in names], 0).T.astype(self.wdt)
            y = b.op("MatMul", x, b.init(name + ".T", stacked))
        elif (
            all(isinstance(f, BlockQuantized) for f in forms)
            and len({(f.bits, f.block, f.mins is None) for f in forms}) == 1
        ):
            y = self.matmul(x, name, BlockQuantized.concat(forms))
        elif all(isinstance(f, ChannelQuantized) for f in forms):
            joined = ChannelQuantized(np.concatenate([f.q for f in forms]), np.concatenate([f.scales for f in forms]))
            y = self.matmul(x, name, joined)
        else:  # quantized differently (e.g. a GGUF's Q4_K beside Q6_K): one MatMul each, then concatenated
            parts = [
                self.matmul(x, n, f) if f is not None else b.op("MatMul", x, b.init(n + ".T", w[n].T.astype(self.wdt)))
                for n, f in zip(names, forms)
            ]
            y = b.op("Concat", *parts, axis=-1)
        if prefixes[0] + ".bias" in w:
            bias = np.concatenate([w[p + ".bias"] for p in prefixes]).astype(self.wdt)
            y = b.op("Add", y, b.init((fused or prefixes[0]).removesuffix(".weight") + ".bias", bias))
        return y

    def matmul(self, x: str, name: str, q) -> str:
        """x [B, S, K] @ q.T -> [B, S, N] for one quantized weight ``q`` (initializers named after ``name``)."""
        if isinstance(q, ChannelQuantized):
            return self._matmul_int8(x, name, q)
        return self._matmul_blocks(x, name, q)

    def _matmul_int8(self, x: str, name: str, q: ChannelQuantized) -> str:
        b = self.b
        inits = self._inits(name, q)
        # uint8 x uint8 around 128: exact int32 sums on every x86 CPU (uint8 x int8 saturates 16-bit pair
        # sums on AVX2 without VNNI: measured, docs/lab/quantization.md).
        xq, xscale = self._quantize_rows(x)
        zero = b.const(128, np.uint8)
        acc = b.op("MatMulInteger", xq, inits["q.T"], zero, zero)  # [B, S, N] int32
        # exact int32 sums x column scales (one op), then row scales
        y = b.op("DequantizeLinear", acc, inits["scales"], axis=-1)
        return b.op("Mul", y, xscale)

    def _matmul_blocks(self, x: str, name: str, q: BlockQuantized) -> str:
        b = self.b
        n, k = q.q.shape
        inits = self._inits(name, q)
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

    def _quantize_rows(self, x: str) -> tuple[str, str]:
        """x [B, S, K] fp32 -> (uint8 rows around 128, scales [B, S, 1]), each row by its own absmax: a row's
        integers ignore other rows. Once per activation, however many weights read it."""
        if x not in self._rows:
            b = self.b
            absmax = b.op("ReduceMax", b.op("Abs", x), axes=[-1], keepdims=0)  # [B, S]
            scale = b.op("Max", b.op("Mul", absmax, b.const(1 / 127, np.float32)), b.const(1e-30, np.float32))
            rows = b.op("Reshape", scale, b.const([-1]))  # [B*S]: one scale per row (batch 1)
            zero = b.op("Expand", b.const(128, np.uint8), b.op("Shape", rows))
            xq = b.op("QuantizeLinear", x, rows, zero, axis=1)  # round(x / scale) + 128, per row
            self._rows[x] = (xq, b.op("Unsqueeze", scale, b.const([-1])))
        return self._rows[x]

    def _inits(self, name: str, q) -> dict:
        """The initializers of quantized weight ``q``, written on first use."""
        if name not in self._stored:
            b = self.b
            if isinstance(q, ChannelQuantized):
                wq = (q.q.T.astype(np.int16) + 128).astype(np.uint8)  # [K, N]: uint8 around 128
                self._stored[name] = {
                    "q.T": b.init(name + ".q.T", np.ascontiguousarray(wq)),
                    "scales": b.init(name + ".scales", q.scales),
                }
            else:
                data, scales, zero = q.packed()
                self._stored[name] = {
                    "q": b.init(name + ".q", data),
                    "scales": b.init(name + ".scales", scales),
                    "zero_points": b.init(name + ".zero_points", zero),
                }
                if q.mins is not None:
                    self._stored[name]["mins.T"] = b.init(name + ".mins.T", np.ascontiguousarray(q.mins.T))
        return self._stored[name]

    # ---- quantized gathers
    def rows(self, ids: str, name: str, q) -> str:
        """Rows ``ids`` [B, S] of the quantized weight ``q`` [N, K], dequantized in the graph from the same
        initializers the MatMul reads: [B, S, K] fp32, equal bit for bit to ``q.dequantize()[ids]``."""
        if isinstance(q, ChannelQuantized):
            return self._rows_int8(ids, name, q)
        return self._rows_blocks(ids, name, q)

    def _rows_int8(self, ids: str, name: str, q: ChannelQuantized) -> str:
        b = self.b
        inits = self._inits(name, q)  # q.T [K, N] uint8 around 128, scales [N]
        cols = b.op("Transpose", b.op("Gather", inits["q.T"], ids, axis=1), perm=[1, 2, 0])  # [B, S, K]
        vals = b.op("Sub", b.op("Cast", cols, to=TensorProto.FLOAT), b.const(128, np.float32))
        return b.op("Mul", vals, b.op("Unsqueeze", b.op("Gather", inits["scales"], ids, axis=0), b.const([-1])))

    def _rows_blocks(self, ids: str, name: str, q: BlockQuantized) -> str:
        b = self.b
        inits = self._inits(name, q)
        n, k = q.shape
        nb = k // q.block
        data = b.op("Gather", inits["q"], ids, axis=0)  # [B, S, nb, block * bits / 8]
        if q.bits == 4:  # two values per byte, low nibble first
            high = b.op("BitShift", data, b.const(4, np.uint8), direction="RIGHT")
            low = b.op("Sub", data, b.op("BitShift", high, b.const(4, np.uint8), direction="LEFT"))
            data = b.op(
                "Concat", b.op("Unsqueeze", low, b.const([-1])), b.op("Unsqueeze", high, b.const([-1])), axis=-1
            )
        vals = b.op(
            "Reshape", b.op("Cast", data, to=TensorProto.FLOAT), b.const([0, 0, nb, q.block])
        )  # [B, S, nb, block]
        scales = b.op("Gather", b.op("Reshape", inits["scales"], b.const([n, nb])), ids, axis=0)  # [B, S, nb]
        rows = b.op("Mul", b.op("Sub", vals, b.const(float(q.zero.flat[0]), np.float32)), self._per_block(scales))
        if q.mins is not None:  # mins.T [nb, N]
            mins = b.op("Transpose", b.op("Gather", inits["mins.T"], ids, axis=1), perm=[1, 2, 0])  # [B, S, nb]
            rows = b.op("Add", rows, self._per_block(mins))
        return b.op("Reshape", rows, b.const([0, 0, k]))  # [B, S, K]

    def _per_block(self, t: str) -> str:  # [B, S, nb] -> [B, S, nb, 1]
        return self.b.op("Unsqueeze", t, self.b.const([-1]))
