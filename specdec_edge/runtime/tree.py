"""Token trees for verification in one target pass.

A tree is given by ``parents``: node i's parent index (-1 for a child of the last
committed token); nodes are in topological order (parent before child). Node i sits at
position ``past + depth(i)`` and attends to the committed cache and its own ancestors.
A chain of k tokens is the tree ``parents = [-1, 0, 1, ..., k-2]``.
"""

from __future__ import annotations

import numpy as np


def depths(parents) -> np.ndarray:
    parents = np.asarray(parents, dtype=np.int64)
    d = np.zeros(len(parents), dtype=np.int64)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError("tree nodes must be in topological order (parent index < node index)")
        d[i] = 0 if p < 0 else d[p] + 1
    return d


def ancestor_mask(parents) -> np.ndarray:
    """(n, n) bool: mask[i, j] is True when j is i or an ancestor of i."""
    n = len(parents)
    mask = np.eye(n, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def tree_inputs(parents, past: int) -> tuple[np.ndarray, np.ndarray]:
    """position_ids (n,) and attention_bias (1, 1, n, past+n) for verifying a tree after ``past`` tokens."""
    n = len(parents)
    positions = past + depths(parents)
    bias = np.zeros((1, 1, n, past + n), dtype=np.float32)
    bias[0, 0, :, past:] = np.where(ancestor_mask(parents), 0.0, -np.inf)
    return positions, bias


def is_chain(parents: np.ndarray) -> bool:
    """Whether tree ``parents`` (-1: a child of the pending token) form one chain: node i under node i-1."""
    return np.asarray(parents).tolist() == list(range(-1, len(parents) - 1))


def path_to(parents, node: int) -> list[int]:
    """Node indices from the root down to ``node`` (inclusive)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
