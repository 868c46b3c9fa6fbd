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
