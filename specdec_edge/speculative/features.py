"""The target engine seen by proposers that read its features (EAGLE, Medusa heads).

``FeatureTap`` wraps the target engine and keeps the feature of every committed cache slot
(prefill chunks and accepted tree paths alike), so after any step ``tap.features[i]`` is the
target's final-norm hidden state of ``context[i]`` for every ``i < tap.length``; where the graph
has feature layers (EAGLE-3), ``tap.layer_features[i]`` likewise holds the residual streams entering
them. The pending token has no feature yet. The decode loop drives the tap like any engine.

Features stay valid across calls as the cache does: the tap keeps its own ``held`` (the ids of the slots whose
features it wrote), so a new call reuses the prefix that both the engine and the tap hold (``reusable``); another
pipeline over the same engine (``with_method``) has a tap of its own, and committed slots there have no feature
here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import PREFILL_CHUNK, CachedEngine, HeldIds, StepOutput

if TYPE_CHECKING:
    from specdec_edge.bundle.schema import GraphSpec


class FeatureTap(HeldIds):
    """The target engine, plus ``features[i]``: the hidden state of committed cache slot i.

    It offers the loop the engine contract (``runtime.base.Engine``: ``run``, ``commit``, ``rollback``, ``reset``,
    ``length``, ``capacity``, ``max_rows``, ``reusable``) by delegating to the engine it wraps, and that engine's
    exactness settings; the ids of the slots whose features it holds are its own (``HeldIds``). KV snapshots are the
    engine's: the tap adds ``snapshot_features``/``restore_features``.
    """

    graph: GraphSpec  # the wrapped engine's
    capacity: int  # the wrapped engine's cache slots

    def __init__(self, engine: CachedEngine):
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

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def reset(self) -> None:
        self.engine.reset()
        self.held, self._ran = [], None

    def snapshot_features(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Host copies of the committed slots' features (and layer features, where the graph has them)."""
        layers = None if self.layer_features is None else self.layer_features[: self.length].copy()
        return self.features[: self.length].copy(), layers

    def restore_features(self, features: np.ndarray, layers: np.ndarray | None, tokens, start: int = 0) -> None:
        """After the engine's ``restore`` of ``tokens``: their features from a snapshot, slots ``start`` on."""
        n = len(tokens)
        if n != self.length or features.shape[0] < n or features.shape[1:] != self.features.shape[1:]:
            raise SpecdecError(f"features of shape {features.shape} do not fit this target's ({n} slots).")
        self.features[start:n] = features[start:n]
        if self.layer_features is not None:
            if layers is None or layers.shape[1:] != self.layer_features.shape[1:]:
                raise SpecdecError("this target's layer features are not in the snapshot.")
            self.layer_features[start:n] = layers[start:n]
        self.held, self._ran = [int(t) for t in tokens], None

    def reusable(self, tokens) -> int:
        """The leading ``tokens`` whose K/V the engine holds and whose features this tap holds."""
        return min(super().reusable(tokens), self.engine.reusable(tokens))

    def max_rows(self, past: int | None = None) -> int | None:
        return self.engine.max_rows(past)

    # the wrapped engine's exactness settings (runtime/verdicts.py applies them to either)
    min_width = property(lambda self: self.engine.min_width)
    boundaries = property(lambda self: self.engine.boundaries)
    bad_residues = property(lambda self: self.engine.bad_residues)
    max_width = property(lambda self: self.engine.max_width)

    def rollback(self, length: int) -> None:
        self.engine.rollback(length)
        if self.held is not None:
            del self.held[length:]

    def run(self, input_ids, position_ids=None, attention_bias=None, logits_to_keep=None) -> StepOutput:
        return self._ran_with(self.engine.run(input_ids, position_ids, attention_bias, logits_to_keep), input_ids)

    @property
    def prefill_chunk(self) -> int:
        return getattr(self.engine, "prefill_chunk", PREFILL_CHUNK)

    def prefill_run(self, input_ids, logits_to_keep=None) -> StepOutput:
        """A prefill pass by the engine's own prefill path (``runtime.base.prefill``); features kept as ``run``'s."""
        run = getattr(self.engine, "prefill_run", self.engine.run)
        return self._ran_with(run(input_ids, logits_to_keep=logits_to_keep), input_ids)

    def _ran_with(self, out: StepOutput, input_ids) -> StepOutput:
        """Hold a pass's features (valid until the next run) and ids, for ``commit``."""
        self._hidden, self._layers = out.hidden_states, out.layer_features
        self._ran = (self.engine.length, np.asarray(input_ids, dtype=np.int64).reshape(-1))
        return out

    def commit(self, n: int, path=None) -> None:
        if self.held is not None and len(self.held) > self.length:  # the engine was rolled back by another tap
            del self.held[self.length :]
        ids = self._kept_ids(n, path)
        rows = slice(0, n) if path is None else np.asarray(path, dtype=np.int64)[:n]
        start = self.engine.length
        self.features[start : start + n] = self._hidden[rows]
        if self.layer_features is not None:
            self.layer_features[start : start + n] = self._layers[rows]
        self.engine.commit(n, path)  # the wrapped engine compacts its own cache
        self._hold(ids)
