"""Medusa heads at run time: a static tree of rank paths over the heads' top-k tokens.

Head d on the last committed feature ``f[n-2]`` scores the token at depth d after the pending
one; a tree of rank paths (``(0, 1)`` = head 1's best, then head 2's second best) becomes the
proposal. The tree is deterministic, so the loop verifies it exactly (greedy output equals
plain greedy; sampling keeps the target's distribution by recursive rejection over siblings).
Light: numpy and onnxruntime only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from specdec_edge.errors import SpecdecError
from specdec_edge.speculative.features import FeatureTap
from specdec_edge.speculative.proposal import EMPTY, Proposal, Proposer

if TYPE_CHECKING:  # only for type hints: the head sessions live in runtime/
    from specdec_edge.runtime.head_graphs import HeadGraph

# Rank paths of the default Medusa tree: depth 1..5, most likely first (21 nodes).
MEDUSA_TREE = (
    (0,),
    (1,),
    (2,),
    (3,),
    (4,),
    (0, 0),
    (0, 1),
    (0, 2),
    (1, 0),
    (1, 1),
    (2, 0),
    (0, 3),
    (0, 0, 0),
    (0, 0, 1),
    (0, 1, 0),
    (1, 0, 0),
    (0, 0, 2),
    (0, 0, 0, 0),
    (0, 0, 0, 1),
    (0, 0, 1, 0),
    (0, 0, 0, 0, 0),
)


class MedusaProposer(Proposer):
    """A static tree of rank paths over the Medusa heads' top-k tokens."""

    def __init__(self, graph: HeadGraph, tap: FeatureTap, tree=None):
        self.graph, self.tap = graph, tap
        depth_max = graph.config["medusa_heads"]
        tree = tree or [p for p in MEDUSA_TREE if len(p) <= depth_max]
        paths = sorted(dict.fromkeys(tuple(int(r) for r in p) for p in tree), key=len)  # stable: parents first
        for p in paths:
            if not p or len(p) > depth_max or max(p) >= graph.top_k or min(p) < 0:
                raise SpecdecError(
                    f"Medusa tree path {p} is invalid: depth 1..{depth_max}, ranks 0..{graph.top_k - 1}."
                )
            if len(p) > 1 and p[:-1] not in paths:
                raise SpecdecError(f"Medusa tree path {p} has no parent path {p[:-1]}; list every prefix.")
        self.paths = paths
        self.branches = len({p[:-1] for p in paths}) < len(paths)  # some prefix has two children

    def propose(self, context, k) -> Proposal:
        if k <= 0 or self.tap.length == 0:
            return EMPTY
        _, ids = self.graph.run(hidden_states=self.tap.features[self.tap.length - 1 : self.tap.length])  # [K, 1, T]
        paths = [p for p in self.paths if len(p) <= k]
        index = {p: i for i, p in enumerate(paths)}
        tokens = np.array([ids[len(p) - 1, 0, p[-1]] for p in paths], dtype=np.int64)
        parents = np.array([index[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=np.int64)
        return Proposal(tokens, parents=parents, source="medusa")
