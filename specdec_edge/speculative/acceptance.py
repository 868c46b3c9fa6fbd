"""Acceptance rules, in pure numpy: which draft tokens a step keeps, and the target's token after them.

Glossary (one step verifies ``[pending] + draft tokens`` in one target pass):

* accepted tokens: the draft tokens the rule keeps -- a prefix of a chain, or one root-down
  branch of a tree (the *path*);
* correction token: the target's own token at the first rejected position (greedy: its argmax
  there; sampling: drawn from the residual ``norm(max(0, p - q))``);
* bonus token: the target's own token after a fully accepted proposal (drawn from p, or its
  argmax, after the last draft token).

A step emits the accepted tokens plus one correction or bonus token, which becomes the next
pending token. Greedy keeps the longest prefix (or branch) that matches the target's argmax.
Sampling is exact rejection sampling (Leviathan et al. 2023, Chen et al. 2023), whose output
has exactly the target's distribution whatever the draft proposes; trees use its recursive form
over siblings. ``ExactAcceptance`` applies these; ``TypicalAcceptance`` is Medusa's lossy rule.

Shapes: ``draft_tokens`` [k]; ``draft_probs`` (q) [k, V]; ``target_logits`` /
``target_probs`` (p) [k+1, V], where row i is the target's prediction after the prefix
plus ``draft_tokens[:i]``. ``k`` may be 0 (plain decoding).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.tree import is_chain, path_to
from specdec_edge.sampling import SamplingParams, probs_from_logits, sample
from specdec_edge.speculative.proposal import Proposal


def _check_shapes(draft_tokens: np.ndarray, target: np.ndarray, draft_probs: np.ndarray | None = None) -> int:
    k = draft_tokens.shape[0] if draft_tokens.ndim == 1 else -1
    if k < 0 or target.ndim != 2 or target.shape[0] != k + 1:
        raise SpecdecError(
            f"acceptance needs draft_tokens [k] and target rows [k+1, V]; got {draft_tokens.shape} and {target.shape}."
        )
    if draft_probs is not None and draft_probs.shape != (k, target.shape[1]):
        raise SpecdecError(f"draft_probs must have shape [k, V] = {(k, target.shape[1])}, got {draft_probs.shape}.")
    return k


def accept_greedy(draft_tokens: np.ndarray, target_logits: np.ndarray) -> tuple[int, int]:
    """Return ``(n_accepted, next_token)`` for greedy verification.

    ``n_accepted`` is the longest prefix with ``draft_tokens[i] == argmax(target_logits[i])``;
    ``next_token`` is ``argmax(target_logits[n_accepted])``: the correction or the bonus token.
    """
    draft_tokens = np.asarray(draft_tokens)
    target_logits = np.asarray(target_logits)
    k = _check_shapes(draft_tokens, target_logits)
    for i in range(k):  # row by row: the rows after the first miss are never read (each is vocabulary-wide)
        token = int(target_logits[i].argmax())
        if token != draft_tokens[i]:
            return i, token
    return k, int(target_logits[k].argmax())


def accept_sampling(
    draft_tokens: np.ndarray,
    draft_probs: np.ndarray,
    target_probs: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Return ``(n_accepted, next_token)`` by exact rejection sampling.

    ``draft_probs`` (q) holds the distribution each draft token was drawn from (a one-hot
    for deterministic proposers such as prompt lookup); ``target_probs`` (p) must come from
    ``probs_from_logits`` with the same params as the draft's.
    """
    draft_tokens = np.asarray(draft_tokens)
    q = np.asarray(draft_probs, dtype=np.float64)
    p = np.asarray(target_probs, dtype=np.float64)
    k = _check_shapes(draft_tokens, p, q)
    for i in range(k):
        x = int(draft_tokens[i])
        # Rule: accept x with probability min(1, p(x)/q(x)); else draw from norm(max(0, p - q)).
        # Written as u * q(x) < p(x) (u in [0, 1)), so q(x) == 0 accepts iff p(x) > 0 and
        # a token the target rules out (p(x) == 0) is never accepted.
        if rng.random() * q[i, x] < p[i, x]:
            continue
        return i, sample(residual_distribution(p[i], q[i]), rng)
    return k, sample(p[k], rng)


def residual_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``norm(max(0, p - q))`` over the last axis; where that is all zeros (p == q), ``p``."""
    p = np.asarray(p, dtype=np.float64)
    residual = np.maximum(p - np.asarray(q, dtype=np.float64), 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    return np.where(mass > 0, residual / np.where(mass > 0, mass, 1.0), p)


def accepted_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The exact output distribution of one step of the rule at a single position.

    ``P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y q(y) min(1, p(y)/q(y))) * residual(p, q)(x)``;
    ``q(x) min(1, p(x)/q(x))`` is ``min(p(x), q(x))``, which also covers ``q(x) == 0``.
    Equals ``p`` for any ``q``, which is what the tests check.
    """
    p = np.asarray(p, dtype=np.float64)
    accepted = np.minimum(p, np.asarray(q, dtype=np.float64))
    rejected_mass = 1.0 - accepted.sum(axis=-1, keepdims=True)
    return accepted + rejected_mass * residual_distribution(p, q)


def accept_tree_greedy(tokens: np.ndarray, parents: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, int]:
    """Greedy acceptance over a token tree.

    ``logits[0]`` follows the pending token, ``logits[1 + i]`` follows node i. A node is right
    when its token is the target's argmax after its parent; the deepest node whose whole
    branch is right is accepted (so duplicate siblings cannot hide a longer match).
    Returns the accepted path (node indices, root first) and the target's next token.
    """
    parents = np.asarray(parents, dtype=np.int64)
    best = logits.argmax(axis=-1)
    path = deepest_branch(parents, tokens == best[parents + 1])
    return path, int(best[path[-1] + 1 if len(path) else 0])


def deepest_branch(parents: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """The deepest node whose branch (it and all its ancestors) is ``ok``, as its path root first
    (the first such node on equal depth; empty when no root child is ok). Nodes come parents first."""
    depth = np.zeros(len(parents), dtype=np.int64)  # accepted depth of each node's branch, 0 = not accepted
    for i, parent in enumerate(parents):
        if ok[i] and (parent < 0 or depth[parent] > 0):
            depth[i] = 1 if parent < 0 else depth[parent] + 1
    if not depth.any():
        return np.zeros(0, dtype=np.int64)
    return np.array(path_to(parents, int(depth.argmax())), dtype=np.int64)


def accept_tree_sampling(
    tokens: np.ndarray, parents: np.ndarray, target_probs: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, int]:
    """Exact sampling over a tree of deterministic proposals (recursive rejection over siblings).

    At each node, try its children in order: accept child x with probability p(x); on
    rejection set p(x) = 0 and renormalise (the residual of a one-hot draft), then try the
    next. If every child is rejected, sample the next token from what is left of p. Each
    emitted token is therefore distributed exactly as the target's p.
    """
    parents = np.asarray(parents, dtype=np.int64)
    path, node = [], -1
    while True:
        p = target_probs[node + 1].astype(np.float64, copy=True)
        for child in np.flatnonzero(parents == node):
            x = tokens[child]
            if rng.random() * p.sum() < p[x]:  # p is renormalised implicitly by its sum
                path.append(int(child))
                node = int(child)
                break
            p[x] = 0.0
        else:
            total = p.sum()
            p = p / total if total > 0 else target_probs[node + 1]
            return np.array(path, dtype=np.int64), sample(p, rng)


# Medusa's typical acceptance (Cai et al., 2024, section 2.3.1): the paper's defaults.
TYPICAL_EPSILON, TYPICAL_DELTA = 0.09, 0.3


def accept_tree_typical(
    tokens: np.ndarray,
    parents: np.ndarray,
    target_probs: np.ndarray,
    rng: np.random.Generator,
    epsilon: float = TYPICAL_EPSILON,
    delta: float = TYPICAL_DELTA,
) -> tuple[np.ndarray, int]:
    """Typical acceptance over a token tree. LOSSY: the output does not follow the target's distribution.

    A node is plausible when the target gives its token, after its parent, a probability above
    ``min(epsilon, delta * exp(-H))``, H being the entropy of that distribution: confident
    rows demand a likely token, flat rows accept more. The deepest node whose whole branch is
    plausible is accepted (the first of equal depth), and the next token is sampled from the
    target after it. It accepts more than exact rejection sampling and so drifts from the
    target's distribution; ``medusa-typical`` is the only method that uses it.
    """
    parents = np.asarray(parents, dtype=np.int64)
    p = np.asarray(target_probs, dtype=np.float64)
    entropy = -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=-1)
    threshold = np.minimum(epsilon, delta * np.exp(-entropy))
    rows = parents + 1
    path = deepest_branch(parents, p[rows, tokens] > threshold[rows])
    return path, sample(p[path[-1] + 1 if len(path) else 0], rng)


class AcceptanceRule(ABC):
    """Decides, for one verified proposal, the accepted path and the target's next token.

    The decode loop takes one rule object; a method's registry record says which (``methods.py``).
    """

    lossy = False  # True: sampling no longer follows the target's distribution (greedy stays exact)

    @abstractmethod
    def __call__(
        self, proposal: Proposal, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator
    ) -> tuple[np.ndarray, int]:
        """Args:
            proposal: the verified draft (chain or tree) of m tokens.
            logits: [1+m, V] target logits; row 0 follows the pending token, row 1+i follows node i.
            params: sampling parameters (greedy when temperature is 0).
            rng: the generation's random generator.
        Returns:
            ``(path, next_token)``: the accepted nodes (indices into the proposal, root first) and
            the correction or bonus token.
        """


NO_PATH = np.zeros(0, dtype=np.int64)  # no draft token accepted
NO_PATH.flags.writeable = False


class ExactAcceptance(AcceptanceRule):
    """The exact rules: greedy prefix/branch match, or rejection sampling (chains and trees)."""

    def __call__(self, proposal, logits, params, rng):
        tokens = np.asarray(proposal.tokens, dtype=np.int64)
        if params.greedy and not len(tokens):  # a plain step: the pending token's argmax
            return NO_PATH, int(np.argmax(logits[0]))
        if proposal.parents is not None and not is_chain(proposal.parents):  # (a chain-shaped tree is a chain)
            if params.greedy:
                return accept_tree_greedy(tokens, proposal.parents, logits)
            return accept_tree_sampling(tokens, proposal.parents, probs_from_logits(logits, params), rng)
        if params.greedy:
            n, token = accept_greedy(tokens, logits)
            return np.arange(n), token
        p = probs_from_logits(logits, params)
        q = proposal.probs
        if q is None:  # a deterministic proposer drew each token with probability 1
            q = np.zeros((len(tokens), logits.shape[-1]))
            q[np.arange(len(tokens)), tokens] = 1.0
        n, token = accept_sampling(tokens, q, p, rng)
        return np.arange(n), token


EXACT = ExactAcceptance()


class TypicalAcceptance(AcceptanceRule):
    """Medusa's typical acceptance when sampling (LOSSY, see ``accept_tree_typical``); greedy stays exact."""

    lossy = True

    def __init__(self, epsilon: float = TYPICAL_EPSILON, delta: float = TYPICAL_DELTA):
        self.epsilon, self.delta = epsilon, delta

    def __call__(self, proposal, logits, params, rng):
        if params.greedy:
            return EXACT(proposal, logits, params, rng)
        tokens = np.asarray(proposal.tokens, dtype=np.int64)
        parents = proposal.parents if proposal.parents is not None else np.arange(len(tokens)) - 1
        return accept_tree_typical(tokens, parents, probs_from_logits(logits, params), rng, self.epsilon, self.delta)
