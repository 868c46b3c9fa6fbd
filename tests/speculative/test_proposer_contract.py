"""Every registered method's proposer against the ``Proposer`` contract, through scripted accept patterns.

The script drives a real target engine the way the decode loop does -- propose, verify in one
pass, observe, commit n accepted nodes plus a target token (or none, as when generation stops) --
with accept patterns chosen by the test, not by the target: all accepted, none, some, a tree
branch that is not laid out first. After every step the proposal must be well formed and, for
every proposer whose state is a function of the context, equal to what a fresh proposer
prefilled with the same context proposes (so no rejected token leaks into its state).
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec_edge import Pipeline
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.runtime.tree import depths, path_to
from specdec_edge.sampling import SamplingParams
from specdec_edge.speculative.history import HistoryStore
from specdec_edge.speculative.loop import prefill, verify
from specdec_edge.speculative.methods import METHODS
from specdec_edge.speculative.proposal import Proposal


def bundle_fixture(method: str) -> str:
    """The bundle fixture that runs ``method``, from what the registry says it needs: the EAGLE-3 bundle, the one with
    EAGLE and Medusa heads (also for ``auto``, which then has every candidate), else the one with a draft model."""
    needs = set(METHODS[method].needs)
    if "eagle3" in needs:
        return "eagle3_bundle"
    return "heads_bundle" if needs & {"eagle", "medusa"} or method == "auto" else "tiny_bundle"


BUNDLE = {name: bundle_fixture(name) for name in METHODS}  # every registered method
# Proposers whose proposals depend on more than the context: lookahead's Jacobi window and n-gram pool
# remember what earlier steps guessed.
HISTORY_DEPENDENT = {"lookahead", "auto"}  # auto: its choices follow what it has measured and learned
# Tree depth: at most k, but lookahead's Jacobi window has its own shape (window + ngram - 2 levels deep).
MAX_DEPTH = {"lookahead": 4 + 3 - 2, "auto": 4 + 3 - 2}
# (accepted nodes, with the target's own token): all, none, some, eos or the length limit inside a proposal
PATTERNS = [(9, True), (0, True), (2, True), (1, False), (9, True), (3, True), (2, False), (9, True)]
K = 4


def test_every_registered_method_has_a_bundle_that_runs_it(request):
    for name, fixture in BUNDLE.items():
        manifest = read_manifest(request.getfixturevalue(fixture))
        assert METHODS[name].missing(manifest.draft is not None, list(manifest.heads)) is None, (name, fixture)


def check_well_formed(proposal: Proposal, k: int, vocab: int, greedy: bool, max_depth: int) -> None:
    tokens = proposal.tokens
    assert tokens.dtype == np.int64 and tokens.ndim == 1
    assert ((0 <= tokens) & (tokens < vocab)).all()
    if proposal.parents is None:
        assert len(tokens) <= k
    else:
        assert proposal.parents.shape == tokens.shape and proposal.probs is None
        assert depths(proposal.parents).max(initial=0) < max_depth  # raises on a node before its parent
    if proposal.probs is not None:
        assert not greedy and proposal.probs.shape == (len(tokens), vocab)
        np.testing.assert_allclose(proposal.probs.sum(axis=-1), 1.0, atol=1e-6)


def scripted_path(proposal: Proposal, n: int) -> np.ndarray:
    """``n`` accepted nodes (fewer if the proposal is shallower): a chain prefix, or the branch down to the
    last-laid-out node of the deepest level reachable, so that tree commits must compact."""
    if proposal.parents is None:
        return np.arange(min(n, len(proposal.tokens)))
    if not len(proposal.tokens) or n == 0:
        return np.zeros(0, dtype=np.int64)
    d = depths(proposal.parents)
    level = min(n - 1, int(d.max()))
    return np.array(path_to(proposal.parents, int(np.flatnonzero(d == level)[-1])), dtype=np.int64)


def fresh_proposal(fresh: Pipeline, context: list[int], params, rng_seed: int, history) -> Proposal:
    prefill(fresh.decoder.engine, context[:-1])
    fresh.decoder.proposer.prefill(context, params, np.random.default_rng(rng_seed), history=history)
    return fresh.decoder.proposer.propose(context, K)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0)], ids=["greedy", "sampling"])
@pytest.mark.parametrize("method", list(BUNDLE))
def test_proposer_follows_the_contract(method, params, request):
    bundle = request.getfixturevalue(BUNDLE[method])
    pipe = Pipeline.load(bundle, method=method, k=K, threads=1)
    fresh = Pipeline.load(bundle, method=method, k=K, threads=1)  # own engines: a proposer from scratch
    engine, proposer, vocab = pipe.decoder.engine, pipe.decoder.proposer, pipe.engines.target.vocab_size
    rng = np.random.default_rng(7)
    context = pipe.encode("the quick brown fox jumps over the lazy dog the quick brown fox")
    store = HistoryStore()  # an earlier call that saw this text, and more (read only here: both draft from it)
    store.add(context + [int(t) for t in rng.integers(3, vocab, 40)])
    prefill(engine, context[:-1])
    proposer.prefill(context, params, np.random.default_rng(0), history=store)
    proposed = 0
    for n, with_token in PATTERNS:
        proposal = proposer.propose(context, K)
        check_well_formed(proposal, K, vocab, params.greedy, MAX_DEPTH.get(method, K))
        if method not in HISTORY_DEPENDENT:
            want = fresh_proposal(fresh, context, params, 0, store)
            if proposal.probs is not None:  # sampled drafts: the first token's distribution follows the context
                np.testing.assert_allclose(proposal.probs[0], want.probs[0], atol=1e-5)
            else:
                assert proposal.tokens.tolist() == want.tokens.tolist(), (method, len(context))
            assert (proposal.parents is None) == (want.parents is None)
            if proposal.parents is not None:
                assert proposal.parents.tolist() == want.parents.tolist()
        proposed += len(proposal.tokens)
        logits, hidden = verify(engine, context[-1], proposal)
        proposer.observe(proposal, logits, hidden)
        path = scripted_path(proposal, n)
        emitted = proposal.tokens[path].tolist()
        if with_token or not emitted:  # a step always emits something: a stop inside a proposal cuts after a draft
            emitted.append(int(rng.integers(3, vocab)))
        engine.commit(len(emitted), None if proposal.parents is None else np.concatenate([[0], path + 1]))
        context = context + emitted
        proposer.commit(context)
        assert engine.length == len(context) - 1
    if method != "plain":
        assert proposed > 0, f"{method} proposed nothing: the test would prove little"


def test_pld_eagle_proposes_by_both_branches(heads_bundle):
    """Prompt lookup where an n-gram of 2+ tokens repeats, EAGLE elsewhere: both must take steps, and the
    output stays plain's."""
    plain = Pipeline.load(heads_bundle, method="plain", threads=1)
    pipe = plain.with_method("pld-eagle", k=K)
    steps = {"first": 0, "second": 0}  # steps whose proposal each branch made
    first, second = pipe.decoder.proposer.first.propose, pipe.decoder.proposer.second.propose

    def by_first(context, k):
        proposal = first(context, k)
        steps["first"] += bool(len(proposal.tokens))
        return proposal

    def by_second(context, k):
        steps["second"] += 1
        return second(context, k)

    pipe.decoder.proposer.first.propose, pipe.decoder.proposer.second.propose = by_first, by_second
    for prompt in (
        "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over",
        "speculative decoding verifies draft tokens",
    ):
        assert pipe.generate(prompt, max_new_tokens=40).token_ids == plain.generate(prompt, max_new_tokens=40).token_ids
    assert steps["first"] > 0 and steps["second"] > 0, steps
