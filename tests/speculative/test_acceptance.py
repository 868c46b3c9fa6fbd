"""The acceptance rules: greedy prefix matching and exact rejection sampling.

Exactness is shown twice: analytically (``accepted_distribution`` equals p) and
statistically (a chi-square goodness-of-fit test on sampled outcomes), and a
deliberately wrong rule must fail the same statistical test.
"""

import numpy as np
import pytest

from specdec_edge.errors import SpecdecError
from specdec_edge.sampling import make_rng, sample
from specdec_edge.speculative.acceptance import (
    TYPICAL_DELTA,
    TYPICAL_EPSILON,
    accept_greedy,
    accept_sampling,
    accept_tree_sampling,
    accept_tree_typical,
    accepted_distribution,
    residual_distribution,
)

V = 8
N_DRAWS = 20_000
# Upper 0.001 quantile of the chi-square distribution with V - 1 = 7 degrees of freedom
# (standard tables; the Wilson-Hilferty approximation gives 24.5).
CHI2_CRIT_DF7_P001 = 24.322


def _random_dist(rng, size, sparsity=0.0):
    w = rng.exponential(size=size)
    w[rng.random(size) < sparsity] = 0.0
    if w.sum() == 0:
        w[rng.integers(size)] = 1.0
    return w / w.sum()


def _one_hot(i, size=V):
    q = np.zeros(size)
    q[i] = 1.0
    return q


def _chi2(samples, p):
    """Pearson's statistic of ``samples`` against ``p`` (which must have full support)."""
    counts = np.bincount(samples, minlength=len(p))
    expected = len(samples) * p
    return float(((counts - expected) ** 2 / expected).sum())


def _first_emitted(rule, p_rows, q_rows, seed, n=N_DRAWS):
    """Sample draft tokens from q, run ``rule``, return the first emitted token of each step."""
    rng = make_rng(seed)
    k = len(q_rows)
    out = np.empty(n, dtype=np.int64)
    for j in range(n):
        draft = np.array([sample(q, rng) for q in q_rows])
        n_acc, nxt = rule(draft, q_rows, p_rows, rng)
        out[j] = draft[0] if (k and n_acc >= 1) else nxt
    return out


def _always_accept(draft, q_rows, p_rows, rng):
    return len(draft), sample(p_rows[-1], rng)


# A target with full support, and drafts that differ from it in every way that matters.
P0 = np.array([0.30, 0.05, 0.20, 0.10, 0.02, 0.13, 0.15, 0.05])
DRAFTS = {
    "dense": np.array([0.05, 0.30, 0.05, 0.20, 0.10, 0.10, 0.05, 0.15]),
    "sparse": np.array([0.0, 0.6, 0.0, 0.0, 0.4, 0.0, 0.0, 0.0]),
    "one_hot": _one_hot(4),
    "equal": P0.copy(),
}


# --- analytic -------------------------------------------------------------------------


def test_accepted_distribution_equals_p_exactly():
    rng = np.random.default_rng(0)
    for trial in range(500):
        size = int(rng.integers(1, 40))
        p = _random_dist(rng, size, sparsity=rng.choice([0.0, 0.5, 0.9]))
        if trial % 3 == 0:
            q = _one_hot(int(rng.integers(size)), size)
        else:
            q = _random_dist(rng, size, sparsity=rng.choice([0.0, 0.5, 0.9]))
        np.testing.assert_allclose(accepted_distribution(p, q), p, rtol=0, atol=1e-9)


def test_accepted_distribution_is_vectorised():
    rng = np.random.default_rng(1)
    p = np.stack([_random_dist(rng, V) for _ in range(5)])
    q = np.stack([_random_dist(rng, V, sparsity=0.5) for _ in range(5)])
    np.testing.assert_allclose(accepted_distribution(p, q), p, atol=1e-12)


def test_residual_distribution():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.2, 0.4, 0.2, 0.2])
    np.testing.assert_allclose(residual_distribution(p, q), [1.0, 0, 0, 0])
    # p == q leaves nothing to correct: fall back to p.
    np.testing.assert_array_equal(residual_distribution(p, p), p)
    # A one-hot draft: the residual is p with the proposed token removed.
    np.testing.assert_allclose(residual_distribution(p, _one_hot(0, 4)), [0, 0.6, 0.4, 0])


# --- statistical ----------------------------------------------------------------------


@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_first_token_follows_target_chi_square(draft):
    samples = _first_emitted(accept_sampling, np.stack([P0, P0]), DRAFTS[draft][None], seed=11)
    assert _chi2(samples, P0) < CHI2_CRIT_DF7_P001


@pytest.mark.parametrize("draft", ["dense", "sparse", "one_hot"])
def test_wrong_rule_fails_chi_square(draft):
    samples = _first_emitted(_always_accept, np.stack([P0, P0]), DRAFTS[draft][None], seed=11)
    assert _chi2(samples, P0) > CHI2_CRIT_DF7_P001


def test_first_token_follows_target_with_k3():
    rng = np.random.default_rng(5)
    p_rows = np.stack([P0] + [_random_dist(rng, V) for _ in range(3)])
    q_rows = np.stack([DRAFTS["dense"], _random_dist(rng, V, 0.5), _one_hot(2)])
    samples = _first_emitted(accept_sampling, p_rows, q_rows, seed=12)
    assert _chi2(samples, P0) < CHI2_CRIT_DF7_P001


def test_acceptance_rate_is_sum_of_min():
    q = DRAFTS["dense"]
    rng = make_rng(13)
    accepted = sum(accept_sampling([sample(q, rng)], q[None], np.stack([P0, P0]), rng)[0] for _ in range(N_DRAWS))
    rate = np.minimum(P0, q).sum()
    assert abs(accepted / N_DRAWS - rate) < 4 * np.sqrt(rate * (1 - rate) / N_DRAWS)


# --- sampling rule edge cases ---------------------------------------------------------


def test_draft_equal_to_target_accepts_everything():
    rng = make_rng(0)
    p = np.stack([_random_dist(np.random.default_rng(i), V) for i in range(5)])
    for _ in range(200):
        draft = np.array([sample(row, rng) for row in p[:4]])
        n_acc, bonus = accept_sampling(draft, p[:4], p, rng)
        assert n_acc == 4 and 0 <= bonus < V


def test_token_ruled_out_by_target_is_never_accepted():
    p = np.stack([_one_hot(1), _one_hot(3)])
    rng = make_rng(0)
    for _ in range(100):
        assert accept_sampling(np.array([0]), _one_hot(0)[None], p, rng) == (0, 1)


def test_proposed_token_with_zero_draft_prob_is_safe():
    # An inconsistent q (q(x) == 0 for the proposed x): accepted iff the target allows x.
    p = np.stack([P0, P0])
    q = _one_hot(0)[None]
    rng = make_rng(0)
    assert accept_sampling(np.array([3]), q, p, rng)[0] == 1
    p_zero = np.stack([_one_hot(1), P0])
    assert accept_sampling(np.array([3]), q, p_zero, rng) == (0, 1)


def test_sampling_k0_samples_target():
    p = _one_hot(6)[None]
    assert accept_sampling(np.array([], dtype=np.int64), np.zeros((0, V)), p, make_rng(0)) == (0, 6)


def test_sampling_is_reproducible():
    rng_a, rng_b = make_rng(99), make_rng(99)
    q = np.stack([DRAFTS["dense"]] * 3)
    p = np.stack([P0] * 4)
    draft = np.array([1, 3, 7])
    assert [accept_sampling(draft, q, p, rng_a) for _ in range(50)] == [
        accept_sampling(draft, q, p, rng_b) for _ in range(50)
    ]


# --- greedy ---------------------------------------------------------------------------


def _logits_for(tokens, vocab=V):
    logits = np.zeros((len(tokens), vocab))
    logits[np.arange(len(tokens)), tokens] = 5.0
    return logits


def test_greedy_accepts_longest_matching_prefix():
    target = _logits_for([3, 1, 4, 1])
    assert accept_greedy(np.array([3, 1, 5]), target) == (2, 4)
    assert accept_greedy(np.array([2, 1, 4]), target) == (0, 3)


def test_greedy_bonus_token_when_all_match():
    assert accept_greedy(np.array([3, 1, 4]), _logits_for([3, 1, 4, 7])) == (3, 7)


def test_greedy_k0_is_argmax():
    logits = np.array([[0.1, 0.9, 0.9, -2.0]])
    assert accept_greedy(np.array([], dtype=np.int64), logits) == (0, 1)


def test_greedy_stops_at_first_mismatch_even_if_later_tokens_match():
    assert accept_greedy(np.array([3, 0, 4]), _logits_for([3, 1, 4, 1])) == (1, 1)


def test_shape_errors_are_clear():
    with pytest.raises(SpecdecError, match=r"\[k\+1, V\]"):
        accept_greedy(np.array([1, 2]), np.zeros((2, V)))
    with pytest.raises(SpecdecError, match="draft_probs"):
        accept_sampling(np.array([1]), np.zeros((2, V)), np.zeros((2, V)), make_rng(0))


# ---- Medusa's typical acceptance (lossy by design)
def typical_probs() -> np.ndarray:
    """Row 0 (after the pending token) is confident in token 0 but gives token 1 0.15; row 2 is flat."""
    p = np.full((4, 6), 0.01)
    p[0] = [0.80, 0.15, 0.02, 0.01, 0.01, 0.01]
    p[1] = [0.05, 0.05, 0.85, 0.03, 0.01, 0.01]
    p[2] = [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]
    p[3] = [0.01, 0.01, 0.01, 0.95, 0.01, 0.01]
    return p


def test_typical_threshold_follows_entropy():
    p = typical_probs()
    entropy = -(p * np.log(p)).sum(axis=-1)
    threshold = np.minimum(TYPICAL_EPSILON, TYPICAL_DELTA * np.exp(-entropy))
    # tree: node 0 = token 1 under the root (p 0.15 > threshold of the confident row 0),
    # node 1 = token 4 under node 0 (row 1 gives it 0.01: implausible),
    # node 2 = token 2 under the root (0.02: implausible), node 3 = token 5 under node 0 (0.01)
    assert p[0, 1] > threshold[0] and p[1, 4] < threshold[1] and p[0, 2] < threshold[0]
    path, _ = accept_tree_typical(np.array([1, 4, 2, 5]), np.array([-1, 0, -1, 0]), p, make_rng(0))
    assert path.tolist() == [0]
    # a flat row accepts a token a confident row would not: token 4 at 0.10 after a chain 1 -> 2
    path, token = accept_tree_typical(np.array([1, 2, 4]), np.array([-1, 0, 1]), p, make_rng(0))
    assert path.tolist() == [0, 1, 2] and token == 3  # the bonus row 3 is near one-hot on token 3
    path, _ = accept_tree_typical(np.array([2]), np.array([-1]), p, make_rng(0))
    assert path.tolist() == []


def test_typical_acceptance_is_lossy():
    """A draft that always proposes the target's second choice is always accepted: the first token is
    then token 1 every time, though the target gives it 0.15. Exact rejection keeps p; typical does not."""
    p = typical_probs()
    firsts_typical = [
        accept_tree_typical(np.array([1]), np.array([-1]), p, make_rng(s))[0].tolist() for s in range(200)
    ]
    assert all(f == [0] for f in firsts_typical)
    exact = [accept_tree_sampling(np.array([1]), np.array([-1]), p, make_rng(s)) for s in range(2000)]
    share = np.mean([len(path) == 1 for path, _ in exact])
    assert abs(share - 0.15) < 0.03


def test_greedy_rule_equals_the_argmax_of_every_row_with_ties():
    rng = np.random.default_rng(3)
    for _ in range(500):
        k = int(rng.integers(0, 6))
        logits = rng.integers(0, 3, (k + 1, 7)).astype(np.float32)  # few values: ties are common
        best = logits.argmax(axis=-1)
        draft = np.where(rng.random(k) < 0.7, best[:k], rng.integers(0, 7, k))
        miss = np.flatnonzero(draft != best[:k])
        n = int(miss[0]) if miss.size else k
        assert accept_greedy(draft, logits) == (n, int(best[n]))
