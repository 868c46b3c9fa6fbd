"""``--method auto``: per-step choice of proposer, width and tree from measured costs.

Invariants: auto's greedy output equals plain's token for token on bundles with a draft model and
with trained heads; sampling keeps the target's distribution; with scripted costs and acceptance
models the chooser takes a plain step when verification is dear and acceptance low, and the whole
tree when width is free; the guard falls back to plain steps when measured throughput is below
plain's; the cost cache is keyed by bundle, provider, device and threads; per-proposer stats reach
the stats, bench and chat.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import numpy as np
import pytest

from specdec_edge import Pipeline
from specdec_edge.api.step_costs import CHAIN_WIDTHS, WIDTHS, CostKey, cost_path, load_costs
from specdec_edge.bundle.hashes import manifest_digest
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.exactness import trees_allowed
from specdec_edge.runtime.device import device_identity
from specdec_edge.runtime.verdicts import verdict_path
from specdec_edge.sampling import SamplingParams, make_rng, probs_from_logits
from specdec_edge.speculative.auto import (
    FIXED_FLOOR,
    FIXED_PRIOR,
    FIXED_PROBE,
    GUARD_WINDOW,
    AutoProposer,
    Candidate,
    accepted_nodes,
    depth_to_ask,
)
from specdec_edge.speculative.costs import CostModel
from specdec_edge.speculative.loop import decode, prefill
from specdec_edge.speculative.methods import Resources, auto_candidates
from specdec_edge.speculative.predictors import Calibrated, NodeRates, prefix_order
from specdec_edge.speculative.proposal import EMPTY, Proposal, Proposer, subset
from specdec_edge.speculative.stats import Stats
from tests.speculative.test_acceptance import CHI2_CRIT_DF7_P001
from tests.speculative.test_methods import TEXTS, assert_greedy_equals_plain


def scripted_costs(row_cost: float, base: float = 0.01) -> CostModel:
    """A cost model whose pass of w rows costs ``base + row_cost * (w - 1)`` seconds at every context."""
    row = [base + row_cost * (w - 1) for w in WIDTHS]
    return CostModel(list(WIDTHS), [64, 512], [row, row])


class Scripted(Proposer):
    def __init__(self, proposal: Proposal):
        self.proposal = proposal

    def propose(self, context, k):
        return self.proposal


def fixed_rates(rate: float) -> NodeRates:
    """An acceptance model that believes every node is accepted with ``rate`` once its parent is (a prior no count
    can move)."""
    return NodeRates(key=lambda p, proposer, i: i, prior=lambda p, proposer, i: rate, strength=1e12)


def tree(n: int) -> Proposal:
    """n nodes: four children of the pending token, the rest below them."""
    parents = np.array([-1 if i < 4 else (i - 4) // 4 for i in range(n)], dtype=np.int64)
    return Proposal(np.arange(10, 10 + n, dtype=np.int64), parents=parents, source="tree")


# ---- the chooser, with scripted costs and acceptance


def test_plain_step_when_verification_is_dear_and_acceptance_low():
    auto = AutoProposer([Candidate("tree", Scripted(tree(20)), fixed_rates(0.05))], scripted_costs(0.01))
    assert auto.propose([1, 2, 3], 4) is EMPTY


def test_whole_tree_when_width_is_free():
    auto = AutoProposer([Candidate("tree", Scripted(tree(20)), fixed_rates(0.3))], scripted_costs(0.0))
    chosen = auto.propose([1, 2, 3], 4)
    assert len(chosen.tokens) == 20 and chosen.source == "tree"


def test_a_prefix_when_width_costs_something():
    # Each extra row costs a tenth of a pass; node i is accepted with 0.9 ** (i + 1): the first nodes pay.
    proposal = Proposal(np.arange(5, 17, dtype=np.int64), source="chain")
    model = NodeRates(key=lambda p, pr, i: i, prior=lambda p, pr, i: 0.9, strength=1e12)
    auto = AutoProposer([Candidate("chain", Scripted(proposal), model)], scripted_costs(0.001))
    chosen = auto.propose([1, 2, 3], 12)
    assert 1 <= len(chosen.tokens) < 12
    np.testing.assert_array_equal(chosen.tokens, proposal.tokens[: len(chosen.tokens)])


def test_the_better_proposer_wins():
    weak = Candidate("weak", Scripted(Proposal(np.array([7, 8]), source="weak")), fixed_rates(0.2))
    strong = Candidate("strong", Scripted(Proposal(np.array([5, 6]), source="strong")), fixed_rates(0.9))
    auto = AutoProposer([weak, strong], scripted_costs(0.001))
    assert auto.propose([1, 2, 3], 4).source == "strong"


def test_two_proposals_merge_into_one_tree_when_width_is_cheap():
    chain = Candidate("chain", Scripted(Proposal(np.array([5, 6, 7]), source="chain")), fixed_rates(0.5))
    other = Candidate("other", Scripted(Proposal(np.array([5, 9]), source="other")), fixed_rates(0.5))
    auto = AutoProposer([chain, other], scripted_costs(0.0))
    merged = auto.propose([1, 2, 3], 4)
    assert merged.source == "chain+other" and merged.parents is not None
    # The shared first token once: 5 -> 6 -> 7 and 5 -> 9.
    assert sorted(merged.tokens.tolist()) == [5, 6, 7, 9]
    assert sorted(auto._chosen.parts[1][2].tolist()) == [merged.tokens.tolist().index(t) for t in (5, 9)]
    chains_only = AutoProposer([chain, other], scripted_costs(0.0), trees=False)
    assert chains_only.propose([1, 2, 3], 4).parents is None


class Deep(Proposer):
    """A chain of ``k`` tokens, costing ``seconds`` a call (a head or draft model: the costly kind); records k."""

    def __init__(self, seconds: float):
        self.seconds, self.asked = seconds, []

    def propose(self, context, k):
        self.asked.append(k)
        time.sleep(self.seconds)
        return Proposal(np.arange(5, 5 + k, dtype=np.int64), source="deep")


def test_a_costly_proposer_is_asked_one_level_past_what_its_options_are_worth():
    # Rows cost 60 % of a pass each and 30 % of nodes are accepted: one node is worth verifying, never four.
    costly = Deep(0.003)
    auto = AutoProposer([Candidate("deep", costly, fixed_rates(0.3))], scripted_costs(0.006))
    widths = [len(auto.propose([1, 2, 3], 6).tokens) for _ in range(20)]
    # (the first ask, before its cost is known, is for all k)
    assert costly.asked[0] == 6 and len(costly.asked) > 1 and max(costly.asked[1:]) == 2 and max(widths) <= 1
    # Width nearly free and nodes nearly always accepted: the depth asked grows a level at a time up to k.
    costly = Deep(0.003)
    auto = AutoProposer([Candidate("deep", costly, fixed_rates(0.95))], scripted_costs(0.0001))
    for _ in range(30):
        auto.propose([1, 2, 3], 6)
    assert costly.asked[1] < 6 and costly.asked[-1] == 6
    assert all(b - a <= 1 for a, b in zip(costly.asked[1:], costly.asked[2:]))
    # A cheap proposer is asked for all k
    cheap = Deep(0.0)
    AutoProposer([Candidate("cheap", cheap, fixed_rates(0.3))], scripted_costs(0.006)).propose([1, 2, 3], 6)
    assert cheap.asked == [6]


def test_the_depth_asked_is_one_level_past_the_rounded_width():
    """A head whose options were worth 1.1 nodes is asked two levels, not three (each level is a head run); one worth
    1.5 or more is asked three, so the depth still grows a level at a time; never below 1 nor above k."""
    asked = {w: depth_to_ask(Candidate("head", Deep(0.001), fixed_rates(0.5), width=w), 6) for w in
             (0.0, 0.4, 1.0, 1.1, 1.49, 1.5, 2.2, 2.6, 5.9)}  # fmt: skip
    assert asked == {0.0: 1, 0.4: 1, 1.0: 2, 1.1: 2, 1.49: 2, 1.5: 3, 2.2: 3, 2.6: 4, 5.9: 6}


def test_the_guard_falls_back_to_plain_then_tries_again():
    auto = AutoProposer([Candidate("tree", Scripted(tree(8)), fixed_rates(0.5))], scripted_costs(0.0))
    assert len(auto.propose([1, 2, 3], 4).tokens) == 8
    # A window of steps that emitted 1 token in 10x a plain pass's time: below plain.
    auto.window.extend([(1, 0.1)] * GUARD_WINDOW)
    auto._guard(3)
    assert auto.plain_until > auto.step  # the guard tripped
    steps = [len(auto.propose([1, 2, 3], 4).tokens) for _ in range(40)]
    assert steps[:10] == [0] * 10 and steps[-1] == 8  # plain for the back-off, then choosing again


def test_prefix_order_and_subset_keep_a_tree():
    p = tree(12)
    rates = np.linspace(0.9, 0.1, 12)[::-1]  # later nodes look likelier: parents must still come first
    order = prefix_order(p, rates)
    seen = set()
    for node in order:
        assert p.parents[node] < 0 or p.parents[node] in seen
        seen.add(int(node))
    sub = subset(p, order[:6])
    assert all(parent < i for i, parent in enumerate(sub.parents))
    assert sorted(sub.tokens.tolist()) == sorted(p.tokens[order[:6]].tolist())


def test_a_node_never_verified_is_priced_from_what_its_parents_learned():
    model = NodeRates(key=lambda p, pr, i: i, prior=lambda p, pr, i: 0.35)
    chain = Proposal(np.arange(5, 9, dtype=np.int64))
    before = model.rates(chain, None)[0]
    np.testing.assert_allclose(before, 0.35 ** np.arange(1, 5))  # the prior, per step along the chain
    for _ in range(10):  # only the first node verified, accepted every time
        model.update([0], np.array([True]), np.array([True]))
    rates = model.rates(chain, None)[0]
    assert rates[0] == pytest.approx(10.7 / 12)
    np.testing.assert_allclose(rates[1:] / rates[:-1], 0.35)  # deeper nodes follow their parent up
    # A node whose parent was rejected teaches nothing about it; one whose parent was accepted does.
    model.update([0, 1], np.array([False, False]), np.array([True, False]))
    assert 1 not in model.table
    model.update([0, 1], np.array([True, False]), np.array([True, True]))
    assert model.table[1] == [0.0, 1.0]
    # In a tree a node is priced along its own path: node 2 under node 0, node 1 a child of the pending token.
    branching = Proposal(np.array([5, 6, 7]), parents=np.array([-1, -1, 0]))
    rates = model.rates(branching, None)[0]
    assert rates[1] == pytest.approx(0.7 / 3)  # key 1: 0 of 1 with a prior of 0.35 worth 2
    assert rates[2] == pytest.approx(rates[0] * 0.35)  # key 2 unseen: its prior, times its parent's rate


def test_calibration_learns_one_ratio_across_bins():
    model = Calibrated()
    sure = Proposal(np.array([5, 6]), confidence=np.array([0.97, 0.9]))
    assert model.rates(sure, None)[0][0] == pytest.approx(0.97)
    for _ in range(8):  # nodes claimed at 0.97 and 0.9, never accepted
        keys = model.rates(sure, None)[1]
        model.update(keys, np.array([False, False]), np.array([True, False]))
    # A bin it never saw (0.6) is believed far less than it claims: the overall ratio moved.
    fresh = Proposal(np.array([5]), confidence=np.array([0.6]))
    assert model.rates(fresh, None)[0][0] < 0.1
    assert 0 < model.ratio < 0.15


def copy_widths(model, row_cost: float, k: int, until: int) -> list[int]:
    """The widths ``auto`` verifies, step by step, of a prompt-lookup-like chain whose every token the target
    accepts (each pass slept as the cost model prices it), until the context holds ``until`` tokens."""
    truth = list(range(100, 100 + until + k + 2))

    class Copy(Proposer):
        def propose(self, context, k):
            n = len(context)
            return Proposal(np.array(truth[n : n + k], dtype=np.int64), source="copy")

    auto = AutoProposer([Candidate("copy", Copy(), model)], scripted_costs(row_cost))
    context, widths = [1, 2, 3], []
    while len(context) < until:
        proposal = auto.propose(context, k)
        widths.append(len(proposal.tokens))
        time.sleep(auto.costs.verify(len(proposal.tokens) + 1, len(context)))  # the pass, as the cost model says
        auto.observe(proposal, np.zeros((len(proposal.tokens) + 1, 4), np.float32))
        context = context + truth[len(context) : len(context) + len(proposal.tokens) + 1]
        auto.commit(context)
    return widths


def test_auto_verifies_deeper_where_the_first_tokens_keep_being_accepted():
    # A prior of 0.3 per step and rows at 10 % of a pass: at first one token is worth verifying (plus one untried
    # node), then the learned rates carry the width up (a model of unconditional rates left every unverified node at
    # 0.3 ** depth and kept the width at 2). Not 0.35: one and two tokens were then priced within 20 us of proposing
    # time of each other, so the first width followed how fast the machine ran the proposer (3 on a slow hour).
    widths = copy_widths(NodeRates(key=lambda p, pr, i: i, prior=lambda p, pr, i: 0.3), 0.001, 6, 120)
    assert widths[0] <= 2 and max(widths) >= 4, widths


def test_a_deeper_node_priced_just_below_its_row_is_still_tried_and_learned():
    """Rows at 30 % of a pass and a prior of 0.42 given the parent: a second node looks not worth its row, so
    verifying only the best prefix would never see one, and its rate would stay the prior forever (prompt lookup on
    an AVX2 CPU ran one token deep in some processes and 2.3 deep in others, 1.31x against 1.40x). A node past the
    best prefix whose key has hardly been verified is verified too, until it has been; here every token is
    accepted, so the width grows."""
    model = NodeRates(key=lambda p, pr, i: i, prior=lambda p, pr, i: 0.42)
    widths = copy_widths(model, 0.003, 4, 150)
    assert widths[-1] >= 3 and model.table[1][1] >= 2, (widths, model.table)


def test_seeded_sampling_asks_the_candidate_this_call_accepted_one_level_past_its_worth():
    """Seeded sampling reads no time and nothing an earlier call taught: the candidate whose proposals this call
    accepted most is asked (each untried one first, in order), one token deep at first and a level deeper while its
    proposals keep being accepted; a new call starts afresh. (The rule before: the first candidate's whole k-token
    proposal, 0.77x plain decoding at temperature 0.7 on an AVX2 CPU.)"""
    truth = list(range(100, 400))

    class Copy(Proposer):  # proposes the text that follows: every token accepted
        def propose(self, context, k):
            return Proposal(np.array(truth[len(context) : len(context) + k], dtype=np.int64), source="copy")

    class Wrong(Proposer):  # proposes tokens the text never has: none accepted
        def propose(self, context, k):
            return Proposal(np.full(k, 7, dtype=np.int64), source="wrong")

    wrong, good = Candidate("wrong", Wrong(), fixed_rates(0.9)), Candidate("copy", Copy(), fixed_rates(0.1))
    auto = AutoProposer([wrong, good], scripted_costs(0.01))
    seeded = SamplingParams(temperature=0.7, seed=3)

    def run(context: list[int], steps: int) -> tuple[list[tuple[str, int]], list[int]]:
        asked = []
        for _ in range(steps):
            proposal = auto.propose(context, 4)
            asked.append((proposal.source, len(proposal.tokens)))
            auto.observe(proposal, np.zeros((len(proposal.tokens) + 1, 4), np.float32))
            accepted = accepted_nodes(proposal, truth[len(context) :])
            context = context + truth[len(context) : len(context) + int(accepted.sum()) + 1]
            auto.commit(context)
        return asked, context

    def call(steps: int) -> list[tuple[str, int]]:
        auto.prefill(truth[:3], seeded, make_rng(3))
        return run(truth[:3], steps)[0]

    first = call(9)
    depths = [n for _, n in first]
    assert first[:2] == [("wrong", 1), ("copy", 1)] and {name for name, _ in first[1:]} == {"copy"}
    assert depths == sorted(depths) and depths[-1] == 4  # a level at a time, up to k
    assert call(9) == first  # the next call learned nothing from this one
    # A call that goes on after another used the engines prefills again with its own rng: its record goes on too.
    rng = make_rng(3)
    auto.prefill(truth[:3], seeded, rng)
    head, context = run(truth[:3], 4)
    call(2)  # another call in between
    auto.prefill(context, seeded, rng)
    assert head + run(context, 5)[0] == first


def test_seeded_sampling_steps_plainly_where_nothing_is_accepted_and_probes_now_and_then():
    """Where this call accepts next to nothing of any candidate (temperature 1.5: 3 % of drafts; asking every step ran
    at 0.84x plain decoding on an AVX-512 CPU), the seeded rule takes plain steps, asking the best-rated candidate
    again on every FIXED_PROBE-th plain step in a row; a probe that is accepted brings the candidate back."""
    truth = list(range(100, 400))
    wrong_from = [10**6]  # positions from here on: the candidate proposes tokens the text never has

    class Sometimes(Proposer):
        def propose(self, context, k):
            if len(context) >= wrong_from[0]:
                return Proposal(np.full(1, 7, dtype=np.int64), source="guess")
            return Proposal(np.array(truth[len(context) : len(context) + 1], dtype=np.int64), source="guess")

    auto = AutoProposer([Candidate("guess", Sometimes(), fixed_rates(0.5))], scripted_costs(0.01))
    auto.prefill(truth[:3], SamplingParams(temperature=1.5, seed=3), make_rng(3))
    context, asked = truth[:3], []
    wrong_from[0] = 3  # nothing accepted from the start
    for step in range(40):
        if step == 26:
            wrong_from[0] = 10**6  # from here on every guess is right
        proposal = auto.propose(context, 4)
        asked.append(len(proposal.tokens))
        auto.observe(proposal, np.zeros((len(proposal.tokens) + 1, 4), np.float32))
        accepted = accepted_nodes(proposal, truth[len(context) :])
        context = context + truth[len(context) : len(context) + int(accepted.sum()) + 1]
        auto.commit(context)
    # FIXED_PRIOR proposals of half a token each: the rejected tries before the rate falls below the floor
    tries = next(n for n in range(1, 40) if 0.5 * FIXED_PRIOR / (n + FIXED_PRIOR) < FIXED_FLOOR)
    assert asked[:tries] == [1] * tries and not any(asked[tries : tries + FIXED_PROBE - 1])
    probes = [i for i in range(tries, 26) if asked[i]]  # then a probe on each FIXED_PROBE-th plain step in a row
    assert probes == list(range(tries + FIXED_PROBE - 1, 26, FIXED_PROBE)) and probes
    first_right = next(i for i in range(26, 40) if asked[i])  # the first probe with the guesses right
    assert first_right == probes[-1] + FIXED_PROBE
    assert asked[first_right:] == [1] * (40 - first_right)  # accepted: asked every step again


def test_seeded_sampling_verifies_a_tree_of_the_bundles_size():
    """Where trees are exact, seeded sampling's rule asks a proposer for a tree as deep as the rule says and
    verifies it cut to the bundle's tree size (``fixed_width``), not to that depth."""
    branching = Candidate("tree", Scripted(tree(9)), fixed_rates(0.5), fixed_width=5)
    auto = AutoProposer([branching], scripted_costs(0.01))
    auto.prefill([1, 2, 3], SamplingParams(temperature=0.7, seed=1), make_rng(1))
    proposal = auto.propose([1, 2, 3], 4)
    assert len(proposal.tokens) == 5 and proposal.parents is not None


def test_accepted_nodes_follow_the_emitted_tokens():
    chain = Proposal(np.array([4, 5, 6]))
    assert accepted_nodes(chain, [4, 5, 9]).tolist() == [True, True, False]
    branching = Proposal(np.array([4, 7, 5, 8]), parents=np.array([-1, -1, 1, 2]))
    assert accepted_nodes(branching, [7, 5, 8, 1]).tolist() == [False, True, True, True]
    assert accepted_nodes(branching, [3]).tolist() == [False] * 4


# ---- on real tiny bundles


@pytest.fixture(scope="module")
def plain(tiny_bundle):
    return Pipeline.load(tiny_bundle, method="plain", threads=1)


@pytest.fixture(scope="module")
def heads_plain(heads_bundle):
    return Pipeline.load(heads_bundle, method="plain", threads=1)


def test_auto_is_the_default_and_greedy_equals_plain_with_a_draft(tiny_bundle, plain):
    auto = Pipeline.load(tiny_bundle, threads=1)
    assert auto.method == "auto" and {c.name for c in auto.decoder.proposer.candidates} == {
        "pld",
        "history",
        "draft",
        "lookahead",
    }
    assert_greedy_equals_plain(plain, auto)


def test_what_auto_learns_is_kept_per_owner(tiny_bundle):
    # The server's owners are its API keys: one key's text must not shape how another's calls run (their speed would
    # tell it), so auto's acceptance models, timings and lookahead's n-gram pool are each owner's own.
    auto = Pipeline.load(tiny_bundle, threads=1)
    proposer = auto.decoder.proposer
    lookahead = next(c.proposer for c in proposer.candidates if c.name == "lookahead")

    def tables():
        return [copy.deepcopy(c.predictor.table) for c in proposer.candidates]

    auto.generate(TEXTS[0] * 3, max_new_tokens=24, owner="a")
    learned_by_a = tables()
    assert proposer.owner == "a" and any(learned_by_a)
    b_prompt = auto.admit(TEXTS[1], max_new_tokens=24)
    b = auto.generate(b_prompt, owner="b")
    assert proposer.owner == "b" and any(tables())
    # a's models were set aside untouched, and b's pool holds only n-grams of b's own prompt and answer.
    assert [c["predictor"].table for c in proposer._owners["a"][0]] == learned_by_a
    text = list(b_prompt.ids) + b.token_ids
    grams = {tuple(text[i : i + lookahead.ngram]) for i in range(len(text))}
    pooled = [(first, *rest) for first, rests in lookahead.pool.items() for rest in rests]
    assert pooled and all(gram in grams for gram in pooled)
    # a's next call starts from what a's calls taught, b's is set aside; the API's own calls (owner None) from priors.
    auto.generate(TEXTS[0], max_new_tokens=8, owner="a")
    assert proposer.owner == "a" and "b" in proposer._owners
    auto.generate(TEXTS[2], max_new_tokens=8)
    assert proposer.owner is None and set(proposer._owners) == {"a", "b"}


def test_auto_greedy_equals_plain_with_heads(heads_bundle, heads_plain):
    auto = Pipeline.load(heads_bundle, threads=1)
    assert {c.name for c in auto.decoder.proposer.candidates} == {"pld", "history", "eagle", "medusa", "lookahead"}
    assert_greedy_equals_plain(heads_plain, auto)


def test_auto_greedy_equals_plain_when_every_option_is_tried(heads_plain, monkeypatch):
    """With width free and probes every other step, auto verifies every proposer's proposals in turn."""
    monkeypatch.setattr("specdec_edge.speculative.auto.PROBE_EVERY", 2)
    pipe = heads_plain.with_method("auto")
    pipe.decoder.proposer.costs = scripted_costs(0.0)
    for c in pipe.decoder.proposer.candidates:
        c.probe_every = 2
    assert_greedy_equals_plain(heads_plain, pipe)
    pipe = heads_plain.with_method("auto")  # fresh: failed probes back off, so the loop above spent lookahead's
    pipe.decoder.proposer.costs = scripted_costs(0.0)
    for c in pipe.decoder.proposer.candidates:
        c.probe_every = 2
    used = set()
    for prompt in TEXTS:
        stats = pipe.generate(prompt, max_new_tokens=40).stats
        used |= {part for name, s in stats.by_proposer.items() if s.steps for part in name.split("+")}
    assert {"pld", "eagle", "medusa", "lookahead"} <= used


def test_auto_sampling_keeps_the_target_distribution(heads_plain):
    """First emitted token over many seeds vs the target's exact top-8 distribution (chi-square, df 7), with
    auto choosing among pld, EAGLE, Medusa and lookahead proposals (width free, so it always speculates)."""
    params = SamplingParams(temperature=1.0, top_k=8)
    prompt = heads_plain.encode("the quick brown fox jumps over the lazy dog the quick brown")
    prefill(heads_plain.engines.target, prompt[:-1])
    p = probs_from_logits(heads_plain.engines.target.run(prompt[-1:]).logits, params)[0]
    support = np.flatnonzero(p)
    pipe = heads_plain.with_method("auto")
    auto = pipe.decoder.proposer
    auto.costs = scripted_costs(0.0)
    firsts, accepted = [], 0
    for seed in range(1500):
        stats = Stats()
        step = next(
            decode(
                pipe.decoder.engine, auto, prompt, max_new_tokens=2, params=params, k=4, rng=make_rng(seed), stats=stats
            )
        )
        firsts.append(step.tokens[0])
        accepted += stats.accepted
    counts = np.array([firsts.count(t) for t in support])
    assert counts.sum() == len(firsts) and len(support) == 8
    expected = p[support] * len(firsts)
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_CRIT_DF7_P001
    assert accepted > 100, f"auto's proposals were accepted {accepted} times: the test would prove little"


def test_auto_builds_chains_only_where_trees_are_not_exact(heads_plain):
    res = Resources(heads_plain.decoder.engine, None, heads_plain.engines.heads, trees=False)
    candidates = auto_candidates(res, {})
    assert {c.name for c in candidates} == {"pld", "eagle", "medusa"}  # no lookahead: its window is a tree
    assert not any(c.proposer.branches for c in candidates)


def test_stats_per_proposer(heads_plain):
    stats = heads_plain.with_method("pld-eagle").generate(TEXTS[0], max_new_tokens=40).stats
    assert sum(s.steps for s in stats.by_proposer.values()) == stats.steps
    assert sum(s.accepted for s in stats.by_proposer.values()) == stats.accepted
    for s in stats.by_proposer.values():
        assert sum(s.widths.values()) == s.steps
        assert s.accepted_at.get(1, 0) >= s.accepted_at.get(2, 0)
    d = stats.as_dict()["by_proposer"]
    assert set(d) == set(stats.by_proposer) and "eagle" in stats.proposer_summary()


# ---- the cost cache


def test_costs_are_cached_per_bundle_provider_device_and_threads(tmp_path, monkeypatch, tiny_bundle, tiny_self_bundle):
    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path))
    lines = []

    def load(bundle, threads):
        # prefill in ONNX Runtime: the identity below is provider "cpu" alone (OpenVINO's prefill has its own,
        # tests/runtime/test_ov_prefill.py)
        pipe = Pipeline.load(bundle, method="auto", threads=threads, progress=lines.append, prefill="onnxruntime")
        return pipe.decoder.proposer.costs

    first = load(tiny_bundle, 1)
    assert first.widths == list(WIDTHS)  # an fp32 graph verifies trees: every width is measured
    measured = sum("measuring" in line for line in lines)
    assert measured == 1 and len(list((tmp_path / "costs").glob("*.json"))) == 1
    assert first.verify(32, 64) >= first.verify(1, 64) > 0
    again = load(tiny_bundle, 1)
    assert sum("measuring" in line for line in lines) == 1 and again.seconds == first.seconds  # from the cache
    load(tiny_bundle, 2)  # other threads
    load(tiny_self_bundle, 1)  # another bundle
    assert sum("measuring" in line for line in lines) == 3
    device = device_identity("cpu", "1")  # what Pipeline.load(threads=1) runs on: the verdict's key too
    key = CostKey.for_bundle(tiny_bundle, device, True, ("pld", "history", "draft", "lookahead"))
    assert load_costs(key) is not None and cost_path(key).is_file()
    graph = read_manifest(tiny_bundle).target.graph
    assert verdict_path(manifest_digest(tiny_bundle), graph.path, device).is_file()  # one identity, both caches
    for changed in (
        replace(key, provider="cuda"),
        replace(key, device="another device"),
        replace(key, bundle="0" * 64),
        CostKey.for_bundle(tiny_bundle, {**device, "isa": ["avx512f"]}, True, key.candidates),  # another CPU
    ):
        assert load_costs(changed) is None
    from click.testing import CliRunner

    from specdec_edge.cli import main

    shown = CliRunner().invoke(main, ["info", str(tiny_bundle)]).output
    assert shown.count("step costs on") == 2 and "relative cost by width" in shown  # threads 1 and 2
    cost_path(key).write_text("{not json")
    assert load_costs(key) is None  # a damaged cache file is measured again, not an error


def test_measuring_is_reported_by_the_commands_and_not_by_the_api(tmp_path, monkeypatch, capsys, tiny_bundle):
    """A fresh cache: the verdict (threads 1 is another setting than the export's) and the step costs are measured.
    The Python API prints nothing; `generate` shows both on stderr, through the same hook."""
    from click.testing import CliRunner

    from specdec_edge.cli import main

    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path / "api"))
    assert Pipeline.load(tiny_bundle, method="auto", threads=1).generate("the quick", max_new_tokens=2).token_ids
    assert list((tmp_path / "api" / "costs").glob("*.json")) and list((tmp_path / "api" / "verdicts").glob("*"))
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path / "cli"))
    args = ["generate", str(tiny_bundle), "--prompt", "the quick", "--method", "auto", "--threads", "1"]
    result = CliRunner().invoke(main, [*args, "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    assert "checking on" in result.stderr and "measuring step costs" in result.stderr
    assert "measuring" not in result.stdout


def test_info_measure_does_a_first_loads_measuring_so_the_first_use_starts_at_once(tmp_path, monkeypatch, tiny_bundle):
    """`info --measure` (provisioning a device with a prebuilt bundle): the prefill choice, the verdict and the step
    costs are measured and cached there, then shown; a `generate` with the same settings measures nothing."""
    from click.testing import CliRunner

    from specdec_edge.cli import main

    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path))
    first = CliRunner().invoke(main, ["info", str(tiny_bundle), "--measure", "--threads", "1"])
    assert first.exit_code == 0, first.output
    assert "checking on" in first.stderr and "measuring step costs" in first.stderr
    assert "measurements took" in first.stderr and "step costs on" in first.stdout
    args = ["generate", str(tiny_bundle), "--prompt", "the quick", "--threads", "1", "--max-new-tokens", "2"]
    then = CliRunner().invoke(main, args)
    assert then.exit_code == 0, then.output
    assert "checking on" not in then.stderr and "measuring" not in then.stderr and "timing" not in then.stderr


def test_auto_seeded_sampling_is_reproducible(heads_bundle):
    """A seed pins the text under auto as under a fixed method, whatever auto learned in between."""
    auto = Pipeline.load(heads_bundle, threads=1)
    sampled = dict(max_new_tokens=30, temperature=0.3, top_k=3, seed=11)
    a = auto.generate(TEXTS[0], **sampled)
    for prompt in TEXTS[1:]:
        auto.generate(prompt, max_new_tokens=30)  # greedy calls teach the models and move the measured costs
    b = auto.generate(TEXTS[0], **sampled)
    assert a.token_ids == b.token_ids and a.stats.accepted > 0


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: {**d, "seconds": [[0.0] * len(d["widths"]) for _ in d["contexts"]]},  # all times 0
        lambda d: {**d, "seconds": [row[:-1] for row in d["seconds"]]},  # rows of the wrong length
        lambda d: {**d, "seconds": [["fast"] * len(d["widths"]) for _ in d["contexts"]]},  # strings for numbers
        lambda d: {**d, "proposers": ["pld"]},  # a wrong type for proposers
        lambda d: {**d, "widths": "1,2,3"},
        lambda d: [d],
    ],
)
def test_a_damaged_cost_file_is_measured_again(tmp_path, monkeypatch, tiny_bundle, damage):
    import json

    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path))
    first = Pipeline.load(tiny_bundle, method="auto", threads=1)
    [path] = (tmp_path / "costs").glob("*.json")
    path.write_text(json.dumps(damage(json.loads(path.read_text()))))
    lines = []
    again = Pipeline.load(tiny_bundle, method="auto", threads=1, progress=lines.append)
    assert sum("measuring" in line for line in lines) == 1  # measured again, and the file rewritten
    assert again.generate("the quick brown fox", max_new_tokens=8).token_ids
    assert CostModel.from_json(json.loads(path.read_text())).seconds[0][0] > 0
    assert first.decoder.proposer.costs.widths == again.decoder.proposer.costs.widths


def test_costs_in_a_read_only_or_blocked_cache_are_measured_and_used(tmp_path, monkeypatch, tiny_bundle):
    """A read-only cache (HOME read-only in a container, ProtectHome=yes) or a directory where the file goes: auto
    measures, warns once, and runs."""
    cache = tmp_path / "cache"
    (cache / "costs").mkdir(parents=True)
    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(cache))
    key = CostKey.for_bundle(tiny_bundle, device_identity("cpu", "1"), True, ("pld", "history", "draft", "lookahead"))
    cost_path(key).mkdir()  # a directory at the file's path
    lines = []
    pipe = Pipeline.load(tiny_bundle, method="auto", threads=1, progress=lines.append, prefill="onnxruntime")
    assert pipe.generate("the quick brown fox", max_new_tokens=8).token_ids
    assert any("warning: cannot write" in line for line in lines)
    cost_path(key).rmdir()
    (cache / "costs").chmod(0o500)  # read-only (root ignores modes: then the directory trick above is the test)
    try:
        assert (
            Pipeline.load(tiny_bundle, method="auto", threads=1, prefill="onnxruntime")
            .generate("the quick", max_new_tokens=4)
            .token_ids
        )
    finally:
        (cache / "costs").chmod(0o700)


def test_cost_lookups_interpolate_like_numpy_at_every_context():
    rng = np.random.default_rng(1)
    contexts = [64, 512, 1500]
    seconds = [sorted(rng.uniform(0.004, 0.05, len(WIDTHS)).tolist()) for _ in contexts]
    model = CostModel(list(WIDTHS), contexts, seconds)
    for context in (10, 64, 100, 100, 512, 700, 1500, 4000, 100):  # repeats and returns: the kept answers
        for width in (0.5, 1, 1.5, 2, 3, 7.25, WIDTHS[-1], WIDTHS[-1] + 5, 2):
            by_width = [np.interp(width, WIDTHS, row) for row in seconds]
            if width > WIDTHS[-1]:  # past the widest measured: the last step's cost per row goes on
                by_width = [row[-1] + (row[-1] - row[-2]) / (WIDTHS[-1] - WIDTHS[-2]) * 5 for row in seconds]
            want = float(np.interp(context, contexts, by_width))
            assert model.verify(width, context) == pytest.approx(want, rel=1e-12, abs=0)


def test_a_device_that_verifies_chains_only_measures_only_chains_widths(tmp_path, monkeypatch, int4_bundle):
    """Where the verdict refuses trees (a 4-bit graph whose tree rows round unlike a chain's), auto's proposals are
    chains of at most k + 1 rows: the widths past 8 are not measured (most of a first load's measuring on a CPU), and
    a wider pass is priced by the measured rows' slope, never below the widest measured pass."""
    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path))
    pipe = Pipeline.load(int4_bundle, method="auto", threads=1, prefill="onnxruntime")
    costs = pipe.decoder.proposer.costs
    assert not trees_allowed(pipe.engines.verdict, "int4")  # else this test would prove nothing here
    assert costs.widths == list(CHAIN_WIDTHS) and costs.key["widths"] == list(CHAIN_WIDTHS)
    eight, six, twelve = costs.verify(8, 64), costs.verify(6, 64), costs.verify(12, 64)
    assert twelve == pytest.approx(eight + (eight - six) * 2, rel=1e-12) and twelve >= eight
    wide = pipe.with_method("auto", k=11)  # chains of up to 12 rows: priced past the measured widths
    prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox"
    plain = pipe.with_method("plain").generate(prompt, max_new_tokens=16).token_ids
    assert wide.generate(prompt, max_new_tokens=16).token_ids == plain
