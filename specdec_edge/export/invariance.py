"""Batch invariance, measured: does a token's result depend on the pass it is computed in?

Speculative decoding is exact only if verifying a token among draft tokens gives the bits it gets
when decoded alone. Kernels may pick another code path (and rounding) for another pass width:
MatMulNBits has one path for a single row and another for several; activation quantization with
one scale per tensor makes every row depend on the others. So export checks the real graph in
the real runtime: for a few contexts, a token's logits row and its K/V cache slot are compared
bit for bit across chain passes of widths 1, 2, 3, 5 and 8 (the other rows arbitrary later
tokens) and a tree pass, and later tokens' rows across passes with different partners.

The verdict: ``min_pass_width`` 1 when every width agrees; 2 when every width from 2 up agrees but a
single row differs -- the runtime then pads one-row passes to two; otherwise the bundle is not batch
invariant and speculation on it is refused (or marked inexact). Trees are judged apart: a node's row
is compared with its branch run as a chain. Fused attention rounds a tree row slightly differently
(its causal key range holds masked non-ancestors): ~1e-5 in fp32 logits, which only a near-tie can
turn into another greedy token; in quantized graphs the activation rounding turns that into whole
logits, so only chain-shaped proposals are exact there (``tree_rows_match``, ``Pipeline``).
"""

from __future__ import annotations

import numpy as np

from specdec_edge.bundle import GraphSpec
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.speculative.tree import path_to, tree_inputs

WIDTHS = (1, 2, 3, 5, 8)
CONTEXT_LENGTHS = (7, 40)
# A tree over the pending token: three children, two grandchildren under the first child (parents, topological).
TREE = [-1, 0, 0, 0, 1, 1]


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
    single_ok, multi_ok, tree_ok, worst_single, worst_tree, rows = True, True, True, 0.0, 0.0, 0
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
        # The second token's row with different partners after it (every width shares its first two tokens).
        second = [results[w][0][1] for w in (2, 3, 5, 8)]
        multi_ok &= all(np.array_equal(r, second[0]) for r in second)
        rows += len(second)
        # A tree pass: every node's row against its branch run as a chain (siblings share a position, and a
        # node's causal key range then holds masked non-ancestors: fused attention may round differently).
        tokens = np.array([pending, *rng.integers(0, graph.vocab_size, len(TREE) - 1)])
        positions, bias = tree_inputs(TREE, past)
        tree_logits, _ = _pass(engine, past, tokens, positions, bias)
        for node in range(len(TREE)):
            branch = path_to(TREE, node)
            chain = _pass(engine, past, tokens[branch])[0][-1]
            tree_ok &= np.array_equal(tree_logits[node], chain)
            worst_tree = max(worst_tree, float(np.abs(tree_logits[node] - chain).max()))
            rows += 1
    min_width = 1 if single_ok and multi_ok else 2 if multi_ok else None
    return {
        "batch_invariant": min_width is not None,
        "min_pass_width": min_width or 1,
        "single_row_matches": bool(single_ok),
        "multi_row_matches": bool(multi_ok),
        "single_row_max_abs_diff": worst_single,
        "tree_rows_match": bool(tree_ok),
        "tree_max_abs_diff": worst_tree,
        "rows_compared": rows,
        "widths": list(WIDTHS),
    }
