"""Training-free methods and tree verification: prompt lookup, lookahead, tree acceptance, compaction.

Invariants: every method's greedy output equals plain greedy token for token; prompt lookup
proposes the right continuation; tree acceptance keeps the target distribution; after a tree
pass whose accepted branch is not laid out consecutively, the compacted cache continues
exactly like a plain chain.
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec_edge import Pipeline, SpecdecError
from specdec_edge.sampling import SamplingParams, make_rng
from specdec_edge.speculative.acceptance import accept_tree_greedy, accept_tree_sampling
from specdec_edge.speculative.lookup import PromptLookupProposer, lookup
from specdec_edge.speculative.loop import decode
from specdec_edge.speculative.proposal import Proposal, Proposer
from specdec_edge.speculative.stats import Stats
from tests.speculative.test_acceptance import CHI2_CRIT_DF7_P001, _chi2, _random_dist

TEXTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "def add(a, b):\n    return a + b\n\ndef add(",
    "Summarize the following article in three sentences. Summarize",
    "héllo wörld, naïve café — 日本語のテキスト 🙂",
    [{"role": "user", "content": "Speculative decoding proposes tokens and verifies them in one pass."}],
]


@pytest.fixture(scope="module")
def plain(tiny_bundle):
    return Pipeline.load(tiny_bundle, method="plain", threads=1)


def many_prompts(n=24, seed=0):
    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over lazy dog speculative decoding tokens pass verify".split()
    return TEXTS + [" ".join(rng.choice(words, size=int(rng.integers(3, 30)))) for _ in range(n - len(TEXTS))]


@pytest.mark.parametrize(
    "method,k,options",
    [
        ("pld", 4, {}),
        ("pld", 8, {"max_ngram": 5, "min_ngram": 2}),
        ("lookahead", 4, {}),
        ("lookahead", 3, {"window": 2, "ngram": 2, "guesses": 2}),
        ("lookahead", 6, {"window": 5, "ngram": 4, "guesses": 6, "prompt_ngrams": False}),
    ],
)
def test_method_greedy_equals_plain(plain, method, k, options):
    assert_greedy_equals_plain(plain, plain.with_method(method, k=k, **options))


def assert_greedy_equals_plain(plain, pipe, prompts=None):
    """``pipe``'s greedy tokens equal ``plain``'s on every prompt, and some proposal was accepted."""
    accepted = 0
    for prompt in prompts or many_prompts():
        ref = plain.generate(prompt, max_new_tokens=40)
        got = pipe.generate(prompt, max_new_tokens=40)
        assert got.token_ids == ref.token_ids, prompt
        assert got.stats.new_tokens == ref.stats.new_tokens
        accepted += got.stats.accepted
    assert accepted > 0, f"{pipe.method} never got a token accepted: the test would prove nothing"


def test_lookahead_sampling_is_seeded_and_valid(plain):
    pipe = plain.with_method("lookahead")
    a = pipe.generate(TEXTS[0], max_new_tokens=30, temperature=0.9, top_k=50, seed=7)
    b = pipe.generate(TEXTS[0], max_new_tokens=30, temperature=0.9, top_k=50, seed=7)
    assert a.token_ids == b.token_ids and a.stats.steps > 0


def test_lookahead_sampling_keeps_the_target_distribution(plain):
    """First emitted token over many seeds vs the target's exact top-8 distribution (chi-square, df 7).

    The pool is seeded with n-grams that start with the pending token and continue with each of the
    target's likely next tokens, so the tree's first level holds several candidates the rule must weigh."""
    from specdec_edge.sampling import probs_from_logits
    from specdec_edge.speculative.loop import prefill

    params = SamplingParams(temperature=1.0, top_k=8)
    ids = plain.encode("the quick brown fox jumps over")
    prefill(plain.engines.target, ids[:-1])
    p = probs_from_logits(plain.engines.target.run(ids[-1:]).logits, params)[0]
    support = np.flatnonzero(p)
    # The prompt repeats (pending, x) for the likely x: lookahead's pool proposes them as siblings.
    prompt = ids + [t for x in support[:4] for t in (ids[-1], int(x), 7)] + [ids[-1]]
    prefill(plain.engines.target, prompt[:-1])
    p = probs_from_logits(plain.engines.target.run(prompt[-1:]).logits, params)[0]
    support = np.flatnonzero(p)
    pipe = plain.with_method("lookahead", k=3, window=2, ngram=3, guesses=4)
    firsts, accepted = [], 0
    for seed in range(1500):
        stats = Stats()
        step = next(
            decode(
                pipe.decoder.engine,
                pipe.decoder.proposer,
                prompt,
                max_new_tokens=2,
                params=params,
                k=3,
                rng=make_rng(seed),
                stats=stats,
            )
        )
        firsts.append(step.tokens[0])
        accepted += stats.accepted
    counts = np.array([firsts.count(t) for t in support])
    assert counts.sum() == len(firsts) and len(support) == 8
    expected = p[support] * len(firsts)
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_CRIT_DF7_P001
    assert accepted > 100, f"lookahead's tree was accepted {accepted} times: the test would prove little"


# ---- prompt lookup on constructed sequences


def test_lookup_proposes_the_continuation():
    seq = np.array([5, 6, 7, 8, 9, 1, 2, 5, 6, 7])
    assert lookup(seq, 3).tolist() == [8, 9, 1]
    assert lookup(seq, 10).tolist() == [8, 9, 1, 2, 5, 6, 7]


def test_lookup_prefers_longest_ngram_then_most_recent():
    # tail (3, 4): the bigram occurred once (-> 50); the unigram 4 also occurs later (-> 60)
    seq = np.array([3, 4, 50, 9, 4, 60, 9, 3, 4])
    assert lookup(seq, 1, max_ngram=2).tolist() == [50]
    assert lookup(seq, 1, max_ngram=1).tolist() == [60]
    seq = np.array([1, 2, 10, 1, 2, 20, 1, 2])
    assert lookup(seq, 1).tolist() == [20]  # the most recent of two equal-length matches


def test_lookup_without_match_and_min_ngram():
    assert lookup(np.array([1, 2, 3, 4]), 4).tolist() == []
    assert lookup(np.array([7, 1, 2, 7]), 2, min_ngram=2).tolist() == []
    assert lookup(np.array([7, 1, 2, 7]), 2, min_ngram=1).tolist() == [1, 2]
    assert lookup(np.array([7]), 3).tolist() == []


def test_prompt_lookup_proposer_follows_the_context():
    prop = PromptLookupProposer(max_ngram=2)
    prop.prefill([1, 2, 3, 4, 1, 2], SamplingParams(), make_rng(0))
    assert prop.propose([1, 2, 3, 4, 1, 2], 2).tokens.tolist() == [3, 4]
    prop.commit([1, 2, 3, 4, 1, 2, 9, 8])
    assert prop.propose([1, 2, 3, 4, 1, 2, 9, 8], 3).tokens.tolist() == []  # 8 occurs only at the tail
    prop.commit([1, 2, 3, 4, 1, 2, 9, 8, 2])
    assert prop.propose([1, 2, 3, 4, 1, 2, 9, 8, 2], 3).tokens.tolist() == [9, 8, 2]  # latest 2 came before 9
    with pytest.raises(SpecdecError, match="min_ngram <= max_ngram"):
        PromptLookupProposer(max_ngram=1, min_ngram=2)


# ---- tree acceptance


def _logits_picking(best_rows, vocab=16):
    logits = np.zeros((len(best_rows), vocab))
    logits[np.arange(len(best_rows)), best_rows] = 5.0
    return logits


def test_tree_greedy_takes_the_deepest_right_branch():
    # nodes: 0:a(root) 1:b(root) 2:c(under 0) 3:d(under 1) 4:e(under 3)
    tokens = np.array([3, 4, 5, 6, 7])
    parents = np.array([-1, -1, 0, 1, 3])
    # target: after pending -> 4 (node 1), after node1 -> 6 (node 3), after node3 -> 7 (node 4), then 9
    logits = _logits_picking([4, 0, 6, 0, 7, 9])  # rows: pending, node0..node4
    path, nxt = accept_tree_greedy(tokens, parents, logits)
    assert path.tolist() == [1, 3, 4] and nxt == 9
    path, nxt = accept_tree_greedy(tokens, parents, _logits_picking([11, 0, 0, 0, 0, 0]))
    assert path.tolist() == [] and nxt == 11


def test_tree_greedy_duplicate_siblings_do_not_hide_a_longer_match():
    tokens = np.array([3, 3, 8])
    parents = np.array([-1, -1, 1])  # two children "3"; only the second continues with 8
    logits = _logits_picking([3, 0, 8, 2])
    path, nxt = accept_tree_greedy(tokens, parents, logits)
    assert path.tolist() == [1, 2] and nxt == 2


def _tree_first_tokens(rule, p, children, n=20_000, seed=0):
    rng = np.random.default_rng(seed)
    tokens = np.array(children)
    parents = -np.ones(len(children), dtype=np.int64)
    probs = np.tile(p, (1 + len(children), 1))
    firsts = []
    for _ in range(n):
        path, nxt = rule(tokens, parents, probs, rng)
        firsts.append(int(tokens[path[0]]) if len(path) else nxt)
    return np.array(firsts)


@pytest.mark.parametrize("children", [[2], [2, 5, 7], [0, 1, 2, 3, 4, 5, 6]])
def test_tree_sampling_keeps_target_distribution(children):
    p = _random_dist(np.random.default_rng(len(children)), 8)
    assert _chi2(_tree_first_tokens(accept_tree_sampling, p, children), p) < CHI2_CRIT_DF7_P001


def test_wrong_tree_rule_fails_the_same_test():
    def first_child_always(tokens, parents, probs, rng):
        return np.array([0]), 0

    p = _random_dist(np.random.default_rng(3), 8)
    assert _chi2(_tree_first_tokens(first_child_always, p, [2, 5]), p) > CHI2_CRIT_DF7_P001


# ---- compaction: the accepted branch sits after a wrong sibling branch


class OracleTreeProposer(Proposer):
    """Knows the plain greedy continuation; proposes a wrong branch first, the right one second."""

    def __init__(self, reference: list[int]):
        self.reference = reference

    def prefill(self, prompt, params, rng):
        self.prompt_len = len(prompt)

    def propose(self, context, k):
        done = len(context) - self.prompt_len
        right = self.reference[done : done + k]
        if not right:
            return Proposal(np.zeros(0, dtype=np.int64))
        wrong = [(t + 1) % 300 + 3 for t in right]
        tokens = np.array(wrong + right, dtype=np.int64)
        parents = np.array([-1] + list(range(len(wrong) - 1)) + [-1] + list(range(len(wrong), len(tokens) - 1)))
        return Proposal(tokens, parents=parents)  # the right branch's slots start after the wrong one's


def test_compaction_continues_like_a_plain_chain(plain):
    target = plain.engines.target
    for prompt in many_prompts(8, seed=5):
        ids = plain.encode(prompt)
        ref = plain.generate(prompt, max_new_tokens=30)
        reference = [*ref.token_ids, *([2] if ref.finish_reason == "eos" else [])]
        oracle = OracleTreeProposer(reference)
        stats = Stats()
        out = []
        for chunk in decode(target, oracle, ids, max_new_tokens=30, k=4, eos_ids=frozenset({2}), stats=stats):
            out += chunk.tokens
        assert out == reference
        assert stats.accepted >= len(reference) - stats.steps  # nearly every right branch was taken
        assert stats.steps < len(reference)


def test_find_match_agrees_with_comparing_every_window():
    from numpy.lib.stride_tricks import sliding_window_view

    from specdec_edge.speculative.lookup import find_match

    def every_window(tokens, max_ngram, min_ngram):  # the definition: the latest window equal to the tail n-gram
        length = len(tokens)
        for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
            hits = np.flatnonzero((sliding_window_view(tokens[: length - 1], n) == tokens[length - n :]).all(axis=1))
            if len(hits):
                return int(hits[-1] + n), n
        return length, 0

    rng = np.random.default_rng(0)
    found = 0
    for _ in range(3000):
        vocab = int(rng.choice([2, 3, 5, 50]))
        tokens = rng.integers(0, vocab, int(rng.integers(0, 40)))
        max_ngram = int(rng.integers(1, 6))
        min_ngram = int(rng.integers(1, max_ngram + 1))
        want = every_window(tokens, max_ngram, min_ngram)
        assert find_match(tokens, max_ngram, min_ngram) == want, (tokens.tolist(), max_ngram, min_ngram)
        found += want[1] > 0
    assert 1000 < found < 3000  # both outcomes were exercised
