"""The target engine seen by proposers that read its features (EAGLE, Medusa heads).

``FeatureTap`` wraps the target engine and keeps the feature of every committed cache slot
(prefill chunks and accepted tree paths alike), so after any step ``tap.features[i]`` is the
target's final-norm hidden state of ``context[i]`` for every ``i < tap.length``; where the graph
has feature layers (EAGLE-3), ``tap.layer_features[i]`` likewise holds the residual streams entering
them. The pending token has no feature yet. The decode loop drives the tap like any engine.
"""

from __future__ import annotations

import numpy as np

from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import Engine, StepOutput


class FeatureTap(Engine):
    """The target engine, plus ``features[i]``: the hidden state of committed cache slot i."""

    def __init__(self, engine: Engine):
        if not engine.graph.has_hidden_states:
            raise SpecdecError(
                "the target graph has no hidden_states output, which draft heads read; "
                "re-export the bundle with --hidden-states (or with --heads)."
            )
        self.engine = engine
        self.graph = engine.graph
        self.capacity = engine.capacity
        self.features = np.zeros((engine.capacity, engine.graph.hidden_size), dtype=np.float32)  # [capacity, H]
        width = len(engine.graph.feature_layers) * engine.graph.hidden_size
        # [capacity, n*H] when the graph has feature layers, else None
        self.layer_features = np.zeros((engine.capacity, width), dtype=np.float32) if width else None
        self._hidden = self._layers = None  # [S, H] and [S, n*H] of the last run

    @property
    def length(self) -> int:
        return self.engine.length

    def reset(self) -> None:
        self.engine.reset()

    def max_rows(self, past: int | None = None) -> int | None:
        return self.engine.max_rows(past)

    # the wrapped engine's exactness settings (runtime/verdicts.py applies them to either)
    min_width = property(lambda self: self.engine.min_width)
    boundaries = property(lambda self: self.engine.boundaries)
    max_width = property(lambda self: self.engine.max_width)

    def rollback(self, length: int) -> None:
        self.engine.rollback(length)

    def run(self, input_ids, position_ids=None, attention_bias=None, logits_to_keep=None) -> StepOutput:
        out = self.engine.run(input_ids, position_ids, attention_bias, logits_to_keep)
        self._hidden, self._layers = out.hidden_states, out.layer_features  # valid until the next run
        return out

    def commit(self, n: int, path=None) -> None:
        rows = np.arange(n) if path is None else np.asarray(path, dtype=np.int64)[:n]
        start = self.engine.length
        self.features[start : start + n] = self._hidden[rows]
        if self.layer_features is not None:
            self.layer_features[start : start + n] = self._layers[rows]
        self.engine.commit(n, path)

    def _compact(self, path: np.ndarray) -> None:  # the wrapped engine compacts in its own commit
        raise NotImplementedError
