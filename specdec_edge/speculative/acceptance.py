"""Acceptance rules for a chain of draft tokens, in pure numpy.

Greedy: keep the longest prefix of the draft that matches the target's argmax, then
emit the target's own token at the first mismatch (or the bonus token after a full
match). Sampling: exact rejection sampling (Leviathan et al. 2023, Chen et al. 2023),
whose output has exactly the target's distribution whatever the draft proposes.

Shapes: ``draft_tokens`` [k]; ``draft_probs`` (q) [k, V]; ``target_logits`` /
``target_probs`` (p) [k+1, V], where row i is the target's prediction after the prefix
plus ``draft_tokens[:i]``. ``k`` may be 0 (plain decoding).
"""

from __future__ import annotations

import numpy as np

from specdec_edge.errors import SpecdecError
from specdec_edge.sampling import sample


def _check_shapes(draft_tokens: np.ndarray, target: np.ndarray, draft_probs: np.ndarray | None = None) -> int:
    k = draft_tokens.shape[0] if draft_tokens.ndim == 1 else -1
    if k < 0 or target.ndim != 2 or target.shape[0] != k + 1:
        raise SpecdecError(
            f"acceptance needs draft_tokens [k] and target rows [k+1, V]; "
            f"got {draft_tokens.shape} and {target.shape}."
        )
    if draft_probs is not None and draft_probs.shape != (k, target.shape[1]):
        raise SpecdecError(
            f"draft_probs must have shape [k, V] = {(k, target.shape[1])}, got {draft_probs.shape}."
        )
    return k


def accept_greedy(draft_tokens: np.ndarray, target_logits: np.ndarray) -> tuple[int, int]:
    """Return ``(n_accepted, next_token)`` for greedy verification.

    ``n_accepted`` is the longest prefix with ``draft_tokens[i] == argmax(target_logits[i])``;
    ``next_token`` is ``argmax(target_logits[n_accepted])``: the correction or the bonus token.
    """
    draft_tokens = np.asarray(draft_tokens)
    target_logits = np.asarray(target_logits)
    k = _check_shapes(draft_tokens, target_logits)
    target_tokens = np.argmax(target_logits, axis=-1)  # [k+1]
    mismatches = np.flatnonzero(draft_tokens != target_tokens[:k])
    n_accepted = int(mismatches[0]) if mismatches.size else k
    return n_accepted, int(target_tokens[n_accepted])


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
