"""What every engine shares: the host-held valid length of its fixed-capacity KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec_edge.errors import SpecdecError


@dataclass
class StepInputs:
    """One pass's host-side inputs, shaped for the graph: (1, S) ids and positions, (1, 1, S, past+S) bias."""

    ids: np.ndarray
    positions: np.ndarray
    bias: np.ndarray
    keep: int  # logits rows to compute (the last ``keep`` new tokens)


def causal_bias(past: int, seq: int) -> np.ndarray:
    """(1, 1, S, past+S) float32 bias: every new token sees the cache and earlier new tokens."""
    bias = np.zeros((1, 1, seq, past + seq), dtype=np.float32)
    if seq > 1:
        bias[0, 0, :, past:][np.triu_indices(seq, 1)] = -np.inf
    return bias


# GPU engines pad every narrower pass to this many rows (see pad_step); CPU kernels need no padding.
PAD_TO = 32


def pad_step(step: StepInputs, width: int, past: int) -> StepInputs:
    """``step`` widened to ``width`` rows by appending padding tokens, so that every pass has one shape.

    GPU kernels pick their algorithm (and so their rounding) by shape: a token scored in a 1-row
    pass and in a 5-row pass can get logits that differ in the last bits, and a near-tie can then
    flip greedy output. With every decode pass padded to one width, each real row goes through
    the same kernels whichever pass it is in. Padding rows (token 0 at the last real position)
    see the committed cache and themselves only, real rows never see them, and their K/V land in
    slots after the real tokens, beyond the valid length, where the next pass overwrites them.
    The real rows' logits are the first ``step.keep`` of the kept ``step.keep + pad`` rows.
    """
    seq = step.ids.shape[1]
    pad = width - seq
    if pad <= 0:
        return step
    ids = np.concatenate([step.ids, np.zeros((1, pad), np.int64)], axis=1)
    positions = np.concatenate([step.positions, np.repeat(step.positions[:, -1:], pad, axis=1)], axis=1)
    bias = np.full((1, 1, width, past + width), -np.inf, dtype=np.float32)
    bias[0, 0, :seq, : past + seq] = step.bias[0, 0]
    rows = np.arange(seq, width)
    bias[0, 0, seq:, :past] = 0
    bias[0, 0, rows, past + rows] = 0
    return StepInputs(ids, positions, bias, step.keep + pad)


class CacheLength:
    """Mixin for engines: ``length`` committed slots; rollback moves it back and copies nothing.

    The engine sets ``self.graph`` (a ``GraphSpec``) and ``self.length``.
    """

    graph: object
    capacity: int
    length: int = 0

    @property
    def vocab_size(self) -> int:
        return self.graph.vocab_size

    def reset(self) -> None:
        self.length = 0

    def commit(self, n: int, path: np.ndarray | None = None) -> None:
        """Keep n of the tokens from the last ``run``; ``path`` selects tree nodes (indices into it),
        whose cache slots the engine's ``_compact(path)`` moves to ``length..length+n-1``."""
        if path is not None:
            path = np.asarray(path, dtype=np.int64)[:n]
            if not np.array_equal(path, np.arange(n)):
                self._compact(path)
        self.length += n

    def _compact(self, path: np.ndarray) -> None:
        raise NotImplementedError

    def rollback(self, length: int) -> None:
        """Forget every cache slot from ``length`` on (nothing is copied)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback to {length} outside 0..{self.length}")
        self.length = length

    def step_inputs(self, input_ids, position_ids=None, attention_bias=None, logits_to_keep=None) -> StepInputs:
        """Check capacity and fill in the defaults: positions after the cache, a causal bias, all logits."""
        ids = np.ascontiguousarray(np.asarray(input_ids, dtype=np.int64).reshape(1, -1))
        seq, past = ids.shape[1], self.length
        if past + seq > self.capacity:
            raise SpecdecError(
                f"the KV cache holds {self.capacity} tokens and this step needs {past + seq}; "
                "shorten the prompt or max_new_tokens, or export with a larger --capacity."
            )
        if position_ids is None:
            position_ids = np.arange(past, past + seq, dtype=np.int64)
        bias = causal_bias(past, seq) if attention_bias is None else attention_bias
        return StepInputs(
            ids,
            np.ascontiguousarray(np.asarray(position_ids, dtype=np.int64).reshape(1, seq)),
            np.ascontiguousarray(bias, dtype=np.float32),
            seq if logits_to_keep is None else max(1, min(int(logits_to_keep), seq)),
        )
