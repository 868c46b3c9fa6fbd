"""What every prefill runtime's tests check alike (tests/runtime/test_ov_prefill.py, test_graph_prefill.py)."""

from __future__ import annotations

import numpy as np

from specdec_edge import Pipeline
from specdec_edge.runtime.base import prefill

LONG = "Speculative decoding proposes tokens and verifies them in one pass. " * 3  # > MIN_ROWS tokens here


def speculate_under_prefill(bundle, method: str, prefill: str) -> Pipeline:
    """Plain and ``method`` pipelines prefilled by ``prefill`` give the same tokens on two long turns, with and without
    KV reuse (the second turn then reuses the first's cache); returns the speculative pipeline."""
    plain = Pipeline.load(bundle, method="plain", prefill=prefill)
    spec = Pipeline.load(bundle, method=method, prefill=prefill)
    turns = [LONG, LONG + " And once more, in other words."]
    for reuse in (False, True):
        for turn in turns:
            a = plain.generate(turn, max_new_tokens=24, reuse=reuse)
            b = spec.generate(turn, max_new_tokens=24, reuse=reuse)
            assert a.token_ids == b.token_ids, (method, prefill, reuse)
    return spec


def check_prefill_is_deterministic(engine) -> None:
    """Two prefills of the same 200 ids through ``engine``'s prefiller write the same K/V, whatever its cache held."""
    ids = np.random.default_rng(1).integers(3, 300, size=200).tolist()
    prefill(engine, ids)
    first = engine.cache[..., :200, :].copy()
    engine.cache[:] = 7.0  # stale slots must not leak into the next prefill
    prefill(engine, ids)
    assert np.array_equal(engine.cache[..., :200, :], first)
