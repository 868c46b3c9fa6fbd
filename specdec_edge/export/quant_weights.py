"""Quantized linear weights, in the forms the graph builder turns into ONNX Runtime's quantized MatMuls.

* ``BlockQuantized``: n-bit integers in blocks of ``block`` along the input dimension, one scale
  and zero point per block, optionally one additive minimum per block (GGUF Q4_1 and K-quants).
  The graph runs it as ``com.microsoft.MatMulNBits``, plus a small fp32 MatMul of per-block input
  sums for the minima. Made here from fp32 weights (``quantize_blocks``) or carried over from a
  GGUF file as they are (``export/gguf_blocks.py``).
* ``ChannelQuantized``: int8 per output channel, symmetric; the graph quantizes each activation
  row at run time with its own scale and multiplies with ``MatMulInteger`` (exact int32 sums), so
  a row's result does not depend on which other rows share the pass.

Weights follow Hugging Face's layout: ``[N, K]`` (output features x input features).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BlockQuantized:
    """``w[n, k] = scales[n, b] * (q[n, k] - zero[n, b]) + mins[n, b]`` with ``b = k // block``."""

    bits: int  # 4 or 8
    block: int  # values per block along K (16, 32, ...)
    q: np.ndarray  # [N, K] uint8 in 0 .. 2**bits - 1
    scales: np.ndarray  # [N, K // block] float32
    zero: np.ndarray  # [N, K // block] uint8
    mins: np.ndarray | None = None  # [N, K // block] float32, or None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dequantize(self) -> np.ndarray:
        """The fp32 weight [N, K] these blocks stand for."""
        n, k = self.q.shape
        blocks = self.q.reshape(n, k // self.block, self.block).astype(np.float32)
        w = (blocks - self.zero[..., None].astype(np.float32)) * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(n, k)

    def packed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """MatMulNBits inputs: B uint8 [N, K/block, block*bits/8], scales [N * K/block], zero points uint8
        (4 bits: two per byte, low nibble first, [N * ceil(K/block / 2)]; 8 bits: [N * K/block])."""
        n, k = self.q.shape
        nb = k // self.block
        if self.bits == 4:
            pairs = self.q.reshape(n, nb, self.block // 2, 2)
            data = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
            zero = self.zero if nb % 2 == 0 else np.concatenate([self.zero, np.zeros((n, 1), np.uint8)], 1)
            zero = (zero[:, 0::2] | (zero[:, 1::2] << 4)).astype(np.uint8)
        else:
            data, zero = self.q.reshape(n, nb, self.block).astype(np.uint8), self.zero
        return data, self.scales.astype(np.float32).reshape(-1), zero.reshape(-1)

    @staticmethod
    def concat(parts: list[BlockQuantized]) -> BlockQuantized:
        """Stack weights along N (fused projections); they must share bits, block and the use of minima."""
        first = parts[0]
        if any((p.bits, p.block, p.mins is None) != (first.bits, first.block, first.mins is None) for p in parts):
            raise ValueError("cannot fuse weights quantized differently")
        mins = None if first.mins is None else np.concatenate([p.mins for p in parts])
        return BlockQuantized(
            first.bits,
            first.block,
            np.concatenate([p.q for p in parts]),
            np.concatenate([p.scales for p in parts]),
            np.concatenate([p.zero for p in parts]),
            mins,
        )


def quantize_blocks(w: np.ndarray, bits: int = 4, block: int = 32) -> BlockQuantized:
    """Symmetric round-to-nearest block quantization of an fp32 weight [N, K] (K a multiple of ``block``)."""
    n, k = w.shape
    if k % block:
        raise ValueError(f"input size {k} is not a multiple of the block size {block}")
    top = 2 ** (bits - 1) - 1  # 7 for 4 bits: values -7..7, stored as 1..15 around the zero point 8
    blocks = w.reshape(n, k // block, block).astype(np.float32)
    scales = np.abs(blocks).max(-1) / top
    scales[scales == 0] = 1.0
    q = np.clip(np.rint(blocks / scales[..., None]), -top, top) + (top + 1)
    zero = np.full(scales.shape, top + 1, np.uint8)
    return BlockQuantized(bits, block, q.astype(np.uint8).reshape(n, k), scales.astype(np.float32), zero)


@dataclass
class ChannelQuantized:
    """``w[n, k] = scales[n] * q[n, k]``: int8 per output channel, symmetric."""

    q: np.ndarray  # [N, K] int8
    scales: np.ndarray  # [N] float32

    def dequantize(self) -> np.ndarray:
        return self.q.astype(np.float32) * self.scales[:, None]


def quantize_channels(w: np.ndarray) -> ChannelQuantized:
    """Symmetric int8 per output channel of an fp32 weight [N, K]."""
    scales = np.abs(w).max(1).astype(np.float32) / 127
    scales[scales == 0] = 1.0
    q = np.clip(np.rint(w / scales[:, None]), -127, 127).astype(np.int8)
    return ChannelQuantized(q, scales)
