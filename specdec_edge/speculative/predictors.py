"""How likely each proposed node is to be accepted: one small online model per proposer, for ``auto``.

A node is *accepted* when it lies on the path the acceptance rule keeps. The expected number of
accepted tokens of a proposal is the sum of its nodes' acceptance probabilities, whatever its
shape, so ``auto`` can price any prefix of a proposal: the first w nodes in a parent-first order.

Each model keys its nodes by what predicts them and counts, per key, how often such nodes were
verified and accepted, starting from a prior worth a few observations:

* ``NodeRates``: a key per node from the proposer's state -- prompt lookup: (matched n-gram
  length, position); history: (bucket of the match length, position); Medusa: the node's place in
  its static tree; lookahead: pool or Jacobi window, and depth. Each key learns how often its node
  is accepted *once its parent was* (a node whose parent was rejected teaches nothing), and a
  node's probability is the product along its path. So a node that was never verified is priced
  from what its parents learned: when prompt lookup's first tokens are accepted 70 % of the time,
  the fourth is not left at a prior of 0.13 that no verdict can ever correct (``auto`` verified
  prompt lookup one token deep on open text where four tokens paid, 1.21x against pld-eagle's 1.32x).
* ``Calibrated``: for proposers that give their own probability (``Proposal.confidence``: EAGLE's
  path probability, a draft model's): bins of that probability, each learning how often its nodes
  are really accepted. A confident but wrong head is corrected within a few steps.

Models only ever change speed: every proposal is still verified by the exact rules.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable

import numpy as np

from specdec_edge.runtime.tree import depths
from specdec_edge.speculative.proposal import Proposal, Proposer


class Predictor(ABC):
    """Per-node acceptance probabilities of a proposal, learned from the verdicts of earlier ones."""

    truncatable = True  # auto may verify a parent-first prefix of the proposal instead of all of it

    def __init__(self, strength: float = 2.0):
        self.strength = strength  # the prior counts as this many observations
        self.table: dict[Hashable, list[float]] = {}  # key -> [accepted, verified]

    @abstractmethod
    def keys_and_priors(self, proposal: Proposal, proposer: Proposer) -> tuple[list[Hashable], np.ndarray]:
        """Each node's key and prior acceptance probability."""

    def rates(self, proposal: Proposal, proposer: Proposer) -> tuple[np.ndarray, list[Hashable]]:
        """(P(node accepted) for every node, the nodes' keys for ``update``)."""
        keys, priors = self.keys_and_priors(proposal, proposer)
        rates = np.empty(len(keys))
        for i, (key, prior) in enumerate(zip(keys, priors)):
            accepted, seen = self.table.get(key, (0.0, 0.0))
            rates[i] = (accepted + self.strength * prior) / (seen + self.strength)
        return rates, keys

    def untried(self, key: Hashable) -> bool:
        """Whether nodes of ``key`` have hardly been judged: ``auto`` then verifies such a node one past the best
        prefix, so that a rate priced just below its row is learned instead of kept at its prior forever."""
        return False

    def update(self, keys: list[Hashable], accepted: np.ndarray, reached: np.ndarray) -> None:
        """Count one verdict per verified node: ``accepted[i]`` for the node of ``keys[i]``; ``reached[i]``: its
        parent was accepted (or it has none), the only case a conditional model (``NodeRates``) counts."""
        for key, ok in zip(keys, accepted):
            entry = self.table.setdefault(key, [0.0, 0.0])
            entry[0] += bool(ok)
            entry[1] += 1.0


# A node's key is explored until it has been judged this often after its parent was accepted (``untried``).
EXPLORE = 2


class NodeRates(Predictor):
    """Nodes keyed by ``key(proposal, proposer, i)``; each key learns P(accepted | parent accepted), starting
    from ``prior(proposal, proposer, i)``; a node's rate is the product of those along its path."""

    def __init__(self, key: Callable, prior: Callable, strength: float = 2.0, truncatable: bool = True):
        super().__init__(strength)
        self.key, self.prior, self.truncatable = key, prior, truncatable

    def keys_and_priors(self, proposal, proposer):
        m = len(proposal.tokens)
        keys = [self.key(proposal, proposer, i) for i in range(m)]
        return keys, np.array([self.prior(proposal, proposer, i) for i in range(m)], dtype=np.float64)

    def rates(self, proposal, proposer):
        given_parent, keys = super().rates(proposal, proposer)
        parents = chain_parents(proposal)
        rates = given_parent.copy()
        for i, parent in enumerate(parents.tolist()):  # parent-first: a parent's rate is final before its children
            if parent >= 0:
                rates[i] *= rates[parent]
        return rates, keys

    def untried(self, key) -> bool:
        return self.table.get(key, (0.0, 0.0))[1] < EXPLORE

    def update(self, keys, accepted, reached):
        for key, ok, counted in zip(keys, accepted, reached):
            if counted:
                entry = self.table.setdefault(key, [0.0, 0.0])
                entry[0] += bool(ok)
                entry[1] += 1.0


class Calibrated(Predictor):
    """The proposer's own probability of each node, calibrated per bin against what was accepted.

    A bin starts from the node's probability scaled by one ratio learned over every bin (accepted nodes per
    unit of claimed probability), so a proposer that claims too much everywhere (an n-gram table built from
    other text, sure of a token the target rarely picks) is believed less within a few steps, long before each
    of the 20 bins has its own count; the bin's count then refines it.
    """

    def __init__(self, bins: int = 20, strength: float = 4.0, ratio_strength: float = 2.0):
        super().__init__(strength)
        self.bins = bins
        self.claimed = self.accepted = ratio_strength  # the ratio starts at 1, worth this many claimed tokens

    @property
    def ratio(self) -> float:
        """Accepted nodes per unit of the probability their proposer claimed (1: calibrated overall)."""
        return self.accepted / self.claimed

    def keys_and_priors(self, proposal, proposer):
        confidence = np.clip(np.asarray(proposal.confidence, dtype=np.float64), 0.0, 1.0)
        bins = np.minimum((confidence * self.bins).astype(int), self.bins - 1)
        return [int(b) for b in bins], np.minimum(confidence * self.ratio, 1.0)

    def update(self, keys, accepted, reached):
        super().update(keys, accepted, reached)
        self.claimed += sum((b + 0.5) / self.bins for b in keys)  # a bin's centre stands for its nodes' claims
        self.accepted += float(np.sum(accepted))


def chain_parents(proposal: Proposal) -> np.ndarray:
    """Every node's parent index, -1 for the pending token's children (a chain: -1, 0, 1, ...)."""
    if proposal.parents is None:
        return np.arange(-1, len(proposal.tokens) - 1)
    return np.asarray(proposal.parents, dtype=np.int64)


def node_depths(proposal: Proposal) -> np.ndarray:
    """Depth of every node, 1 for the pending token's children (a chain: 1, 2, 3, ...)."""
    if proposal.parents is None:
        return np.arange(1, len(proposal.tokens) + 1)
    return depths(proposal.parents) + 1


def pld_predictor() -> Predictor:
    """Prompt lookup: a longer matched n-gram predicts a longer accepted run."""
    return NodeRates(
        key=lambda p, proposer, i: (min(proposer.matched, 4), i),
        prior=lambda p, proposer, i: 0.6 if proposer.matched >= 2 else 0.35,
    )


def history_predictor() -> Predictor:
    """History (earlier calls' text): a longer match predicts a longer accepted run; buckets of the match
    length (4-7, 8-15, 16-31, 32+ tokens) by position, each learning its own rate."""

    def bucket(proposer) -> int:
        return min(max(proposer.matched.bit_length() - 1, 2), 5)  # 2: < 8 tokens, 3: < 16, 4: < 32, 5: 32+

    return NodeRates(
        key=lambda p, proposer, i: (bucket(proposer), i),
        prior=lambda p, proposer, i: 0.45 + 0.1 * bucket(proposer),
    )


def medusa_predictor() -> Predictor:
    """Medusa's static tree: each node (by its place in the tree of this size) learns its own rate."""
    return NodeRates(
        key=lambda p, proposer, i: (len(p.tokens), i),
        prior=lambda p, proposer, i: 0.5 / (1 + int(i in _later_siblings(p))),
    )


def lookahead_predictor() -> Predictor:
    """Lookahead: its n-gram pool's nodes and its Jacobi window's nodes, by depth. Verified whole (its window
    advances only when verified)."""

    def key(p, proposer, i):
        return ("pool" if i < proposer.pool_nodes else "window", int(node_depths(p)[i]))

    return NodeRates(key=key, prior=lambda p, proposer, i: 0.3, truncatable=False)


def _later_siblings(proposal: Proposal) -> set[int]:
    """Nodes that are not the first child of their parent."""
    if proposal.parents is None:
        return set()
    first, later = set(), set()
    for i, parent in enumerate(proposal.parents.tolist()):
        if parent in first:
            later.add(i)
        else:
            first.add(parent)
    return later


def prefix_order(proposal: Proposal, rates: np.ndarray) -> np.ndarray:
    """Node indices, parents first, most likely first where the tree allows: every prefix is a tree.

    A chain keeps its order. A tree is grown greedily from the root's children, always taking the
    most likely node whose parent is already taken (a node cannot be accepted without its parent,
    so the parent's rate bounds the child's).
    """
    m = len(proposal.tokens)
    if proposal.parents is None:
        return np.arange(m)
    parents = proposal.parents.tolist()
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    order, frontier = [], list(children.get(-1, []))
    while frontier:
        best = max(frontier, key=lambda i: rates[i])
        frontier.remove(best)
        order.append(best)
        frontier.extend(children.get(best, []))
    return np.array(order, dtype=np.int64)
