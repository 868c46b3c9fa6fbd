"""Logits -> probabilities (temperature, top-k, top-p) and seeded sampling.

Exact rejection sampling preserves the distribution it is given, so the draft and
the target must go through the *same* transformation: ``probs_from_logits`` with the
same ``SamplingParams``. Greedy decoding is the limit ``temperature == 0`` and gives a
one-hot of the argmax, so the same acceptance code covers both modes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from specdec_edge.errors import SpecdecError
from specdec_edge.values import is_int as _is_int


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution. Defaults are greedy decoding."""

    temperature: float = 0.0  # 0 => greedy
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1.0 => off
    seed: int | None = None

    def __post_init__(self):
        if not (_is_number(self.temperature) and 0 <= self.temperature < math.inf):  # also rejects NaN
            raise SpecdecError(
                f"temperature={self.temperature!r} is invalid: use a finite number >= 0 (0 means greedy)."
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SpecdecError(f"top_k={self.top_k!r} is invalid: use an integer >= 0 (0 turns it off).")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            raise SpecdecError(f"top_p={self.top_p!r} is invalid: use a number in (0, 1] (1 turns it off).")
        if self.seed is not None and not (_is_int(self.seed) and self.seed >= 0):
            raise SpecdecError(f"seed={self.seed!r} is invalid: use an integer >= 0, or None for a random seed.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Turn logits ``[..., V]`` into float64 probabilities ``[..., V]``.

    Order: temperature, then top-k (tokens tied with the k-th largest logit are kept),
    then top-p (the smallest set of most likely tokens whose mass reaches ``top_p``;
    the most likely token is always kept), then renormalisation. Greedy params give a
    one-hot of ``np.argmax`` (ties go to the lowest index).
    """
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim == 0 or x.shape[-1] == 0:
        raise SpecdecError(f"logits must have shape [..., V] with V >= 1, got shape {x.shape}.")
    vocab = x.shape[-1]
    if params.greedy:
        out = np.zeros_like(x)
        np.put_along_axis(out, np.argmax(x, axis=-1)[..., None], 1.0, axis=-1)
        return out

    # The largest logit is subtracted before dividing: x / T overflows to inf (and inf - inf is NaN) for a
    # tiny T such as 5e-324, while (x - max) / T only goes to -inf, i.e. probability 0 (the greedy limit).
    with np.errstate(over="ignore"):  # a tiny T sends the others to -inf: the intended limit
        x = (x - np.max(x, axis=-1, keepdims=True)) / params.temperature
    if 0 < params.top_k < vocab:
        kth = np.partition(x, vocab - params.top_k, axis=-1)[..., vocab - params.top_k, None]
        x = np.where(x < kth, -np.inf, x)

    probs = np.exp(x)
    probs /= probs.sum(axis=-1, keepdims=True)

    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")  # [..., V] most likely first
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        mass_before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep = np.empty_like(probs, dtype=bool)
        np.put_along_axis(keep, order, mass_before < params.top_p, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a 1-D distribution by inverse CDF with one ``rng.random()``.

    ``probs`` need not be normalised; tokens with zero probability are never drawn.
    """
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 1:
        raise SpecdecError(f"sample() needs a 1-D distribution, got shape {probs.shape}.")
    cdf = np.cumsum(probs)
    if not (cdf.size and cdf[-1] > 0 and np.isfinite(cdf[-1])):
        raise SpecdecError("sample() got a distribution with no positive, finite mass.")
    u = rng.random() * cdf[-1]
    # side="right" skips zero-probability tokens (their CDF step is empty).
    idx = int(np.searchsorted(cdf, u, side="right"))
    # u can round up to the total; fall back to the last token with mass.
    return min(idx, int(np.flatnonzero(probs)[-1]))


def make_rng(seed: int | None) -> np.random.Generator:
    """A numpy Generator; the same seed gives the same stream of draws."""
    return np.random.default_rng(seed)
