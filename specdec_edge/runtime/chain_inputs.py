"""The inputs of a causal-chain pass (a decode step, a chain verified), written into reused buffers.

``CachedEngine.step_inputs`` followed by ``base.pad_step`` builds a pass's inputs afresh: ids, positions after the
cache, a causal bias ``[1, 1, S, past+S]`` and, for a pass narrower than the device's width, the padding rows.
That is a dozen small numpy allocations and writes per pass, and right after a pass (whose weights have swept the
CPU caches) each costs ~10x what it costs in a loop: ~0.2 ms of a 10-15 ms step on a 2-core AVX2 EPYC.
``ChainInputs.fill`` gives the same values from buffers kept per pass width, written with three numpy calls:
the ids, the positions (``past`` + a fixed offset row) and the bias (zeros over the cache, then a fixed
``[W, W]`` block over the new slots). ``tests/runtime/test_chain_inputs.py`` checks it against
``step_inputs`` + ``pad_step`` value for value.
"""

from __future__ import annotations

import numpy as np

from specdec_edge.runtime.base import StepInputs


def new_slots_block(seq: int, width: int) -> np.ndarray:
    """The bias over a pass's own ``width`` slots: real row r sees new tokens 0..r, padding row r only itself
    (``base.pad_step``'s rule); 0 = attend, -inf = masked."""
    rows, cols = np.indices((width, width))
    attend = np.where(rows < seq, cols <= rows, cols == rows)
    return np.where(attend, 0.0, -np.inf).astype(np.float32)


class ChainInputs:
    """Reused input buffers for causal-chain passes of an engine whose graph has ``slots`` cache slots."""

    def __init__(self, slots: int):
        self.slots = slots
        self._buffers: dict[int, tuple] = {}  # width -> (ids [1, W], positions [1, W], flat bias)
        self._shapes: dict[tuple, tuple] = {}  # (seq, width) -> (positions' offsets [W], bias block [W, W])

    def _buffer(self, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The buffers of ``width``-row passes: ids and positions (the same arrays every time: bound once per
        width) and a flat bias as long as the widest bias of that width."""
        if width not in self._buffers:
            flat = np.empty(width * (self.slots + width), np.float32)
            self._buffers[width] = (np.zeros((1, width), np.int64), np.zeros((1, width), np.int64), flat)
        return self._buffers[width]

    def fill(self, ids: np.ndarray, past: int, width: int, keep: int) -> StepInputs:
        """The inputs of ``ids`` ([S] int64, S <= width) after ``past`` slots, padded to ``width`` rows, keeping
        logits for the last ``keep`` real rows (and the padding rows, as ``pad_step`` keeps them)."""
        seq = len(ids)
        if (seq, width) not in self._shapes:
            offsets = np.minimum(np.arange(width), seq - 1)  # padding rows repeat the last real position
            self._shapes[seq, width] = (offsets, new_slots_block(seq, width))
        offsets, block = self._shapes[seq, width]
        id_buf, positions, flat = self._buffer(width)
        id_buf[0, :seq] = ids
        id_buf[0, seq:] = 0
        np.add(offsets, past, out=positions[0])
        bias = flat[: width * (past + width)].reshape(1, 1, width, past + width)
        bias[0, 0, :, :past] = 0.0
        bias[0, 0, :, past:] = block
        return StepInputs(id_buf, positions, bias, keep + width - seq)
