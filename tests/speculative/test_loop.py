"""The decode loop and the draft-model proposer on tiny bundles.

Invariants: speculative greedy equals plain greedy token for token; draft == target
accepts every proposal; plain greedy through ONNX equals transformers' PyTorch greedy;
speculative sampling keeps the target's distribution (chi-square over 20,000 draws of
the first generated token, through the whole loop) and a wrong acceptance rule fails it;
the draft cache stays consistent whatever the target accepted.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import CpuThreads
from specdec_edge.sampling import SamplingParams, probs_from_logits, sample
from specdec_edge.speculative.acceptance import EXACT, AcceptanceRule
from specdec_edge.speculative.loop import GREEDY, decode, prefill
from specdec_edge.speculative.proposers import DraftModelProposer, EmptyProposer
from specdec_edge.speculative.stats import Stats

EOS = frozenset({2})


def engines(bundle: Path) -> tuple[OrtEngine, OrtEngine]:
    m = read_manifest(bundle)
    make = lambda spec: OrtEngine(bundle / spec.graph.path, spec.graph, cpu=CpuThreads(1))  # noqa: E731
    return make(m.target), make(m.draft)


def run(target, proposer, prompt, k=4, max_new_tokens=24, params=GREEDY, eos_ids=EOS, rng=None):
    stats = Stats()
    tokens, reasons = [], []
    for chunk in decode(
        target,
        proposer,
        prompt,
        max_new_tokens=max_new_tokens,
        params=params,
        k=k,
        eos_ids=eos_ids,
        rng=rng,
        stats=stats,
    ):
        tokens += chunk.tokens
        reasons.append(chunk.finish_reason)
    assert reasons[-1] is not None and all(r is None for r in reasons[:-1])
    return tokens, stats, reasons[-1]


def prompts(n=24, vocab=320, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(1, 40))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def pair(tiny_bundle):
    return engines(tiny_bundle)


@pytest.fixture(scope="module")
def self_pair(tiny_self_bundle):
    return engines(tiny_self_bundle)


@pytest.mark.parametrize("k", [1, 4])
def test_speculative_greedy_equals_plain_greedy(pair, k):
    target, draft = pair
    proposer = DraftModelProposer(draft)
    reasons = set()
    for i, prompt in enumerate(prompts()):
        free, _, _ = run(target, EmptyProposer(), prompt, k=k, eos_ids=frozenset())
        eos = frozenset({free[i % 20]}) if i % 2 else EOS  # a random model rarely emits its real eos
        plain, plain_stats, plain_reason = run(target, EmptyProposer(), prompt, k=k, eos_ids=eos)
        spec, stats, reason = run(target, proposer, prompt, k=k, eos_ids=eos)
        assert spec == plain and reason == plain_reason
        assert plain_stats.steps == len(plain) and plain_stats.proposed == 0
        assert stats.new_tokens == len(spec) and stats.accepted <= stats.proposed
        assert sum(stats.accepted_lengths.values()) == stats.steps
        reasons.add(reason)
    assert reasons == {"eos", "length"}  # both stops are exercised


def test_self_draft_accepts_everything(self_pair):
    target, draft = self_pair
    proposer = DraftModelProposer(draft)
    for k in (1, 3, 4):
        for prompt in prompts(8, seed=1):
            plain, _, _ = run(target, EmptyProposer(), prompt, max_new_tokens=5 * (k + 1), eos_ids=frozenset())
            spec, stats, reason = run(target, proposer, prompt, k=k, max_new_tokens=5 * (k + 1), eos_ids=frozenset())
            assert spec == plain and reason == "length"
            assert (stats.steps, stats.proposed, stats.accepted) == (5, 5 * k, 5 * k)
            assert stats.accepted_lengths == {k: 5} and stats.tokens_per_pass == k + 1


def test_eos_and_length_truncate_inside_a_proposal(self_pair):
    target, draft = self_pair
    prompt = prompts(1, seed=2)[0]
    plain, _, _ = run(target, EmptyProposer(), prompt, max_new_tokens=12, eos_ids=frozenset())
    eos = frozenset({plain[6]})  # an "eos" the self-draft proposes mid-chain
    stop_at = plain.index(plain[6]) + 1
    spec, stats, reason = run(target, DraftModelProposer(draft), prompt, k=4, max_new_tokens=12, eos_ids=eos)
    assert spec == plain[:stop_at] and reason == "eos"
    spec, stats, reason = run(target, DraftModelProposer(draft), prompt, k=4, max_new_tokens=7, eos_ids=frozenset())
    assert spec == plain[:7] and reason == "length" and stats.new_tokens == 7


def test_plain_greedy_matches_transformers(tiny_bundle, tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    target, _ = engines(tiny_bundle)
    for prompt in prompts(6, seed=3):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=2, pad_token_id=0
            )
        ours, _, _ = run(target, EmptyProposer(), prompt, max_new_tokens=20)
        assert ours == out[0, len(prompt) :].tolist()


def test_seeded_sampling_is_reproducible(pair):
    target, draft = pair
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95)
    runs = [
        run(target, DraftModelProposer(draft), [5, 6, 7], params=params, rng=np.random.default_rng(7))[0]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


class AlwaysAccept(AcceptanceRule):
    """A deliberately wrong rule: keeps every draft token, then samples the target after them."""

    def __call__(self, proposal, logits, params, rng):
        n = len(proposal.tokens)
        return np.arange(n), sample(probs_from_logits(logits, params)[n], rng)


def _first_token_chi2(pair, n=20_000, rule=EXACT):
    """Chi-square of n first tokens sampled through the whole loop (k=2) against the target's probs."""
    target, draft = pair
    params = SamplingParams(temperature=0.8, top_k=40)
    prompt = [1]
    prefill(target, [])
    p = probs_from_logits(target.run(prompt).logits[0], params)
    proposer, rng = DraftModelProposer(draft), np.random.default_rng(0)
    counts = np.zeros_like(p)
    for _ in range(n):
        chunk = next(decode(target, proposer, prompt, max_new_tokens=3, params=params, k=2, rng=rng, rule=rule))
        counts[chunk.tokens[0]] += 1
    if counts[p == 0].sum():
        return np.inf, 1.0
    expected = n * p
    big = expected >= 5  # pool the rare tokens into one cell
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    df = int(keep.sum()) - 1
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    z = 3.09  # one-sided 0.001 quantile of N(0, 1); Wilson-Hilferty approximation of the chi-square quantile
    crit = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def test_speculative_sampling_keeps_target_distribution(pair):
    stat, crit = _first_token_chi2(pair)
    assert stat < crit


def test_wrong_rule_fails_the_same_test(pair):
    stat, crit = _first_token_chi2(pair, rule=AlwaysAccept())
    assert stat > crit


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0)], ids=["greedy", "sampling"])
def test_draft_cache_consistent_after_any_acceptance(pair, tiny_bundle, params):
    """After each accept pattern, the draft's next proposal equals a fresh draft run on the same context."""
    _, draft = pair
    _, fresh = engines(tiny_bundle)
    rng = np.random.default_rng(1)
    proposer = DraftModelProposer(draft)
    context = [1, 9, 33, 7]
    proposer.prefill(context, params, rng)
    k = 4
    # all accepted + bonus, none accepted, some, eos/max tokens mid-proposal (no target token), again all
    patterns = [(4, True), (0, True), (2, True), (3, False), (1, False), (4, True), (4, True), (0, True)]
    for n, with_target_token in patterns:
        proposal = proposer.propose(context, k)
        check_against_fresh(fresh, context, proposal, params)
        context = context + proposal.tokens[:n].tolist() + ([int(rng.integers(3, 320))] if with_target_token else [])
        proposer.commit(context)
        assert draft.length == len(proposer.seen) and proposer.seen == context[: len(proposer.seen)]
    check_against_fresh(fresh, context, proposer.propose(context, k), params)


def check_against_fresh(fresh, context, proposal, params):
    prefill(fresh, context[:-1])
    logits = fresh.run([context[-1], *proposal.tokens[:-1].tolist()]).logits
    if params.greedy:
        assert proposal.tokens.tolist() == np.argmax(logits, axis=-1).tolist()
    else:
        np.testing.assert_allclose(proposal.probs, probs_from_logits(logits, params), atol=1e-5)


def test_near_ties_counts_close_top2_and_leaves_the_logits_untouched():
    from specdec_edge.speculative.loop import NEAR_TIE, near_ties

    logits = np.array(
        [
            [0.0, 5.0, 5.0 - NEAR_TIE / 2, 1.0],  # a near tie
            [9.0, 1.0, 2.0, 3.0],  # clear winner
            [2.0, 2.0 - NEAR_TIE / 4, 0.0, 0.0],  # the closest tie
            [3.0, 3.0 - 2 * NEAR_TIE, 0.0, 0.0],
        ],
        dtype=np.float32,
    )  # just outside
    before = logits.copy()
    count, gap = near_ties(logits)
    assert count == 2 and gap == pytest.approx(NEAR_TIE / 4, rel=1e-3)
    np.testing.assert_array_equal(logits, before)  # the top entry is masked in place and restored
    assert near_ties(logits, rows=[1, 3]) == (0, 0.0)
    assert near_ties(logits, rows=[0])[0] == 1
    np.testing.assert_array_equal(logits, before)
    assert near_ties(np.zeros((2, 1), np.float32)) == (0, 0.0)
