"""Batch invariance, measured: does a token's result depend on the pass it is computed in?

Speculative decoding is exact only if verifying a token among draft tokens gives the bits it gets
when decoded alone. Kernels may pick another code path (and rounding) for another pass width:
MatMulNBits has one path for a single row and another for several; activation quantization with
one scale per tensor makes every row depend on the others. So export checks the real graph in
the real runtime: for a few contexts, a token's logits row and its K/V cache slot are compared
bit for bit across chain passes of widths 1, 2, 3, 5 and 8 (the other rows arbitrary later
tokens) and a tree pass, and later tokens' rows across passes with different partners.

The verdict: ``min_pass_width`` 1 when every width agrees; 2 when every width from 2 up (and the
tree) agrees but a single row differs -- the runtime then pads one-row passes to two; otherwise
the bundle is not batch invariant and speculation on it is refused (or marked inexact).
"""

from __future__ import annotations

import numpy as np

from specdec_edge.bundle import GraphSpec
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.speculative.tree import tree_inputs

WIDTHS = (1, 2, 3, 5, 8)
CONTEXT_LENGTHS = (7, 40)
TREE = [-1, 0, 1, 0]  # parents of pending, a (under pending), b (under a), c (under pending)


def _pass(engine: OrtEngine, past: int, tokens, positions=None, bias=None) -> tuple[np.ndarray, np.ndarray]:
    """Logits [S, V] of one pass over ``tokens`` after ``past`` committed slots, and the K/V it wrote
    ([layers, 2, 1, kv_heads, S, head_dim]); the cache length is left at ``past``."""
    engine.rollback(past)
    logits = engine.run(tokens, positions, bias).logits.copy()
    kv = engine.cache[..., past : past + len(tokens), :].copy()
    return logits, kv


def check_batch_invariance(model_path, graph: GraphSpec, *, seed: int = 0) -> dict:
    """The measured verdict for the graph at ``model_path`` (see the module docstring): a JSON-able dict
    with ``batch_invariant``, ``min_pass_width`` and what was compared."""
    rng = np.random.default_rng(seed)
    engine = OrtEngine(model_path, graph, threads=None)
    engine.min_width = 1  # measure the graph itself, unpadded
    single_ok, multi_ok, worst_single, rows = True, True, 0.0, 0
    for length in CONTEXT_LENGTHS:
        context = rng.integers(0, graph.vocab_size, length)
        engine.reset()
        engine.run(context[:-1], logits_to_keep=1)
        engine.commit(length - 1)
        past, pending = length - 1, int(context[-1])
        follow = rng.integers(0, graph.vocab_size, max(WIDTHS))
        # The pending token's row and K/V at every width; partners are later tokens.
        results = {w: _pass(engine, past, [pending, *follow[: w - 1]]) for w in WIDTHS}
        ref_logits, ref_kv = results[2][0][0], results[2][1][..., :1, :]
        for w, (logits, kv) in results.items():
            same = np.array_equal(logits[0], ref_logits) and np.array_equal(kv[..., :1, :], ref_kv)
            rows += 1
            if w == 1:
                single_ok &= same
                worst_single = max(worst_single, float(np.abs(logits[0] - ref_logits).max()))
            else:
                multi_ok &= same
        # The second token's row with different partners after it (widths 3 and 8 share its first two tokens).
        second = [results[w][0][1] for w in (2, 3, 5, 8)]
        multi_ok &= all(np.array_equal(r, second[0]) for r in second)
        rows += len(second)
        # A tree pass: pending, a (child of pending), b (child of a), c (child of pending).
        a, b, c = follow[0], follow[1], rng.integers(0, graph.vocab_size)
        positions, bias = tree_inputs(TREE, past)
        tree_logits, _ = _pass(engine, past, [pending, a, b, c], positions, bias)
        chain = results[3][0]  # pending, a, b
        multi_ok &= all(np.array_equal(tree_logits[i], chain[i]) for i in range(3))
        rows += 3
    min_width = 1 if single_ok and multi_ok else 2 if multi_ok else None
    return {
        "batch_invariant": min_width is not None,
        "min_pass_width": min_width or 1,
        "single_row_matches": bool(single_ok),
        "multi_row_matches": bool(multi_ok),
        "single_row_max_abs_diff": worst_single,
        "rows_compared": rows,
        "widths": list(WIDTHS),
    }
