"""Chain passes from reused buffers (``runtime/chain_inputs.py``): the same inputs, the same bits, as built afresh."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.runtime.base import StepInputs, causal_bias, pad_step
from specdec_edge.runtime.chain_inputs import ChainInputs
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import CpuThreads


def fresh(ids, past: int, width: int, keep: int) -> StepInputs:
    """What ``step_inputs`` + ``pad_step`` build for a causal chain."""
    seq = len(ids)
    positions = np.arange(past, past + seq, dtype=np.int64)[None]
    step = StepInputs(np.asarray(ids, np.int64)[None], positions, causal_bias(past, seq), keep)
    return pad_step(step, width, past)


def test_buffers_hold_what_pad_step_builds():
    chains = ChainInputs(slots=64)
    rng = np.random.default_rng(0)
    # every (rows, width, past) in turn, widths revisited with other rows and pasts: stale values would show
    for _ in range(3):
        for seq in range(1, 7):
            for width in range(seq, 9):
                past = int(rng.integers(0, 40))
                ids = rng.integers(1, 100, seq)
                keep = int(rng.integers(1, seq + 1))
                got, want = chains.fill(ids, past, width, keep), fresh(ids, past, width, keep)
                np.testing.assert_array_equal(got.ids, want.ids)
                np.testing.assert_array_equal(got.positions, want.positions)
                assert got.bias.shape == want.bias.shape and got.bias.flags.c_contiguous
                np.testing.assert_array_equal(got.bias, want.bias)
                assert got.keep == want.keep


def steps(engine: OrtEngine) -> list[np.ndarray]:
    """Prefill, plain steps, a chain with rollback, a tree (built afresh), then chains again: logits and K/V."""
    engine.reset()  # the ids the slots hold are known from here (``held``)
    outs = [engine.run([5, 9, 17, 33, 2, 8, 41], logits_to_keep=1).logits.copy()]
    engine.commit(7)
    for token in (11, 12, 13):
        outs.append(engine.run([token]).logits.copy())
        engine.commit(1)
    outs.append(engine.run([14, 15, 16, 17]).logits.copy())
    engine.commit(2)
    bias = causal_bias(engine.length, 3)
    bias[0, 0, 2, engine.length + 1] = -np.inf  # node 2 is a sibling of node 1
    past = engine.length
    outs.append(engine.run([20, 21, 22], np.array([past, past + 1, past + 1]), bias).logits.copy())
    engine.commit(2, path=np.array([0, 2]))
    for ids in ([30], [31, 32], [33]):
        outs.append(engine.run(ids).logits.copy())
        engine.commit(len(ids))
    outs.append(engine.cache[..., : engine.length, :].copy())
    assert engine.held == [5, 9, 17, 33, 2, 8, 41, 11, 12, 13, 14, 15, 20, 22, 30, 31, 32, 33]
    return outs


@pytest.mark.parametrize("min_width", [1, 2, 3])
def test_buffered_chains_give_the_same_bits_as_fresh_inputs(min_width, tiny_bundle):
    graph = read_manifest(tiny_bundle).target.graph
    runs = []
    for buffered in (True, False):
        engine = OrtEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1))
        engine.min_width = min_width
        if not buffered:
            engine.CHAIN_BUFFER_ROWS = 0  # every pass built by step_inputs + pad_step
        runs.append(steps(engine))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_a_full_cache_is_still_refused_by_name(tiny_bundle):
    graph = read_manifest(tiny_bundle).target.graph
    engine = OrtEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1), capacity=8)
    engine.run(list(range(1, 8)))
    engine.commit(7)
    with pytest.raises(Exception, match="KV cache holds"):
        engine.run([1, 2])
