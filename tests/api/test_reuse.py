"""KV prefix reuse across calls: the engines keep the last call's context, a new call rolls back to the common
prefix and prefills only the rest, and every proposer's state stays consistent with what was kept.

Invariants: an engine's ``held`` is exactly the ids of its committed slots (or None); with reuse every method's
greedy output equals plain decoding's with reuse over a chat-style multi-turn session (and, on these
batch-invariant bundles, the output without reuse); seeded sampling with reuse is reproducible; a proposer that
reused its state proposes what a fresh one proposes for the same context.
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec_edge import LoadSettings, Pipeline
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.exactness import describe
from specdec_edge.sampling import SamplingParams
from specdec_edge.speculative.loop import prefill
from specdec_edge.speculative.proposal import EMPTY

TURNS = [
    "The quick brown fox jumps over the lazy dog. Tell me about the quick brown fox.",
    "And the lazy dog? The quick brown fox jumps over the lazy dog again.",
    "Summarize both in one line: the quick brown fox and the lazy dog.",
]
# method -> bundle fixture (every registered method; speculative/test_proposer_contract.py keeps the registry covered)
SESSIONS = {
    "tiny_self_bundle": ["draft"],  # draft == target: its proposals are accepted, so they are tested
    "tiny_bundle": ["pld", "lookahead", "history", "auto"],  # history: drafts from the pipeline's store too
    "heads_bundle": ["eagle", "medusa", "medusa-typical", "pld-eagle", "auto"],
    "eagle3_bundle": ["eagle3", "pld-eagle3"],
}
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def plain(tiny_bundle):
    return Pipeline.load(tiny_bundle, method="plain", threads=1)


def session(
    pipe, reuse: bool, turns=TURNS, max_new_tokens: int = 24, first_reuse: bool | None = None, chat=True, **gen
):
    """A chat of ``turns``, each turn's history holding the previous answers (``chat`` False: the same as one
    growing text, each answer and turn appended): the results of every turn."""
    history, text, results = [], "", []
    for i, turn in enumerate(turns):
        messages = [*history, {"role": "user", "content": turn}]
        text += (" " if text else "") + turn
        use = reuse if i or first_reuse is None else first_reuse
        results.append(pipe.generate(messages if chat else text, max_new_tokens=max_new_tokens, reuse=use, **gen))
        history = [*messages, {"role": "assistant", "content": results[-1].text}]
        text += results[-1].text
    return results


def test_engine_holds_the_ids_of_its_committed_slots(plain):
    e = plain.engines.target
    prefill(e, [5, 6, 7, 8, 9])
    assert e.held == [5, 6, 7, 8, 9] and e.length == 5
    assert e.reusable([5, 6, 7, 1]) == 3 and e.reusable([5, 6, 7, 8, 9, 10, 11]) == 5 and e.reusable([1]) == 0
    e.run([10, 11, 12])
    e.commit(2)
    assert e.held == [5, 6, 7, 8, 9, 10, 11]
    e.run([20, 21, 22, 23], np.array([7, 8, 8, 9]))
    e.commit(2, np.array([0, 2]))  # a tree path: node 2 is compacted next to node 0
    assert e.held[-2:] == [20, 22] and e.length == 9
    e.rollback(4)
    assert e.held == [5, 6, 7, 8]
    prefill(e, [5, 6, 7, 8, 30, 31], kept=4)  # only the rest is computed
    assert e.held == [5, 6, 7, 8, 30, 31]
    e.commit(1)  # slots committed without a run: their ids are unknown, so nothing is reused
    assert e.held is None and e.reusable([5, 6]) == 0
    e.reset()
    assert e.held == [] and e.reusable([5]) == 0


def test_reuse_prefills_only_the_new_turn(plain):
    plain.generate("warm up", max_new_tokens=2, reuse=False)
    a, b, c = session(plain, True, first_reuse=False)
    assert a.stats.reused_tokens == 0 and a.stats.prefilled_tokens == a.stats.prompt_tokens - 1
    for r in (b, c):
        s = r.stats
        assert s.reused_tokens + s.prefilled_tokens == s.prompt_tokens - 1
        # the whole previous prompt at least is kept (its answer too, where the template re-tokenizes it alike)
        assert s.reused_tokens >= a.stats.prompt_tokens - 1, s
    again = plain.generate(TURNS[0], max_new_tokens=8)
    repeat = plain.generate(TURNS[0], max_new_tokens=8)  # the same prompt: nothing to prefill
    assert repeat.stats.prefilled_tokens == 0 and repeat.token_ids == again.token_ids
    off = plain.generate(TURNS[0], max_new_tokens=8, reuse=False)
    assert off.stats.reused_tokens == 0 and off.token_ids == again.token_ids


def test_the_load_settings_give_the_calls_their_reuse(plain):
    """``LoadSettings.reuse`` (``Pipeline.load``'s keyword, chat's and serve's --reuse/--no-reuse) is the default of
    every call of the pipeline and of those ``with_method`` makes; a call may still set its own."""
    settings, options = LoadSettings().with_keywords({"reuse": False, "max_ngram": 3})
    assert settings == LoadSettings(reuse=False) and options == {"max_ngram": 3}
    assert plain.reuse is True
    off = Pipeline(plain.tokenizer, plain.engines, "plain", reuse=False)
    pld = off.with_method("pld")
    assert pld.reuse is False
    off.generate(TURNS[0], max_new_tokens=2)
    for pipe in (off, pld):
        assert pipe.generate(TURNS[0], max_new_tokens=2).stats.reused_tokens == 0
    assert off.generate(TURNS[0], max_new_tokens=2, reuse=True).stats.reused_tokens > 0


@pytest.mark.parametrize("fixture,method", [(f, m) for f, ms in SESSIONS.items() for m in ms])
def test_every_method_with_reuse_equals_plain_with_reuse(request, fixture, method):
    base = Pipeline.load(request.getfixturevalue(fixture), method="plain", threads=1)
    pipe = base.with_method(method)
    accepted = 0
    for chat in (True, False):
        fresh = session(base, False, chat=chat)
        ref = session(base, True, chat=chat)
        got = session(pipe, True, chat=chat)
        assert [r.token_ids for r in got] == [r.token_ids for r in ref]
        # these fp32 bundles are batch invariant and a reused cache equals a fresh prefill: no-reuse agrees too
        assert [r.token_ids for r in ref] == [r.token_ids for r in fresh]
        assert all(r.stats.reused_tokens > 0 for r in got[1:]) and all(r.stats.reused_tokens > 0 for r in ref[1:])
        accepted += sum(r.stats.accepted for r in got)
    if method != "auto":  # auto may run plain steps only on so short a session
        assert accepted > 0, "no proposal was accepted: the test would prove nothing"
    base.close()


@pytest.mark.parametrize("method", ["plain", "draft", "pld", "lookahead"])
def test_seeded_sampling_with_reuse_is_reproducible(plain, method):
    pipe = plain.with_method(method)
    gen = dict(temperature=0.9, top_k=40, seed=11)
    a = session(pipe, True, first_reuse=False, **gen)
    b = session(pipe, True, first_reuse=False, **gen)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert all(r.stats.reused_tokens > 0 for r in b[1:])


@pytest.mark.parametrize(
    "fixture,method",
    [
        ("tiny_self_bundle", "draft"),
        ("tiny_bundle", "pld"),
        ("heads_bundle", "eagle"),
        ("heads_bundle", "medusa"),
        ("heads_bundle", "pld-eagle"),
        ("eagle3_bundle", "eagle3"),
    ],
)
def test_a_reused_proposer_proposes_what_a_fresh_one_does(request, fixture, method):
    """After a call on one prompt, a call on a longer prompt that shares its start keeps the proposer's state for
    the shared part (the draft's cache, the head caches, the lookup index) and proposes, step after step, what a
    fresh proposer prefilled with the whole prompt proposes."""
    pipe = Pipeline.load(request.getfixturevalue(fixture), method=method, threads=1)
    first = pipe.encode(TURNS[0])
    pipe.generate(TURNS[0], max_new_tokens=12)
    prompt = first + pipe.encode(" " + TURNS[1])[1:]
    kept = pipe.decoder.engine.reusable(prompt[:-1])
    assert kept >= len(first) - 1
    reused = proposals(pipe, prompt, kept)
    other = pipe.with_method(method)  # a fresh proposer (and feature tap) over the same engines
    assert proposals(other, prompt, None) == reused
    pipe.close()


def proposals(pipe, prompt, kept, steps: int = 4) -> list:
    """The proposals of a few greedy steps after ``prompt`` (the target's own token appended after each)."""
    engine, proposer = pipe.decoder.engine, pipe.decoder.proposer
    prefill(engine, prompt[:-1], kept=kept or 0)
    if kept is None:
        proposer.prefill(prompt, GREEDY, np.random.default_rng(0))
    else:
        proposer.prefill(prompt, GREEDY, np.random.default_rng(0), kept)
    context, out = list(prompt), []
    for _ in range(steps):
        p = proposer.propose(context, 4)
        out.append((p.tokens.tolist(), None if p.parents is None else p.parents.tolist()))
        step = engine.run([context[-1]])  # a plain step: the proposal is not verified
        proposer.observe(EMPTY, step.logits, step.hidden_states)
        token = int(step.logits[-1].argmax())
        engine.commit(1)
        context.append(token)
        proposer.commit(context)
    return out


def test_lookahead_keeps_its_pool_and_adds_the_new_prompt(plain):
    pipe = plain.with_method("lookahead")
    pipe.generate(TURNS[0], max_new_tokens=12)
    before = {k: list(v) for k, v in pipe.decoder.proposer.pool.items()}
    prompt = pipe.encode(TURNS[0] + " " + TURNS[1])
    pipe.decoder.proposer.prefill(prompt, GREEDY, np.random.default_rng(0), pipe.decoder.engine.reusable(prompt[:-1]))
    n = pipe.decoder.proposer.ngram
    for i in range(len(prompt) - n + 1):
        assert tuple(prompt[i + 1 : i + n]) in pipe.decoder.proposer.pool[prompt[i]]
    assert all(
        set(v) <= set(pipe.decoder.proposer.pool[k]) or len(pipe.decoder.proposer.pool[k]) >= 4
        for k, v in before.items()
    )


def test_the_verdict_measures_whether_a_reused_cache_equals_a_fresh_prefill(tiny_bundle, wide_heads_bundle):
    tiny = read_manifest(tiny_bundle).target.graph.verdict
    assert tiny.details["reuse_matches_prefill"] is True and tiny.details["reuse_max_abs_diff"] == 0.0
    assert "equals a fresh prefill bit for bit" in describe(tiny, "fp32")
    # Heads 256 wide: a 256-row prefill chunk sums Q.K^T over more keys than a decode pass at the same position,
    # past the key-count boundary where MLAS blocks its sums otherwise, so its K/V round differently.
    wide = read_manifest(wide_heads_bundle).target.graph.verdict
    assert wide.details["boundaries"] and wide.details["reuse_matches_prefill"] is False
    assert 0 < wide.details["reuse_max_abs_diff"] < 1e-3
    assert "differs from a fresh prefill" in describe(wide, "fp32")


def test_reuse_where_it_differs_from_a_fresh_prefill_still_equals_plain_with_reuse(wide_heads_bundle):
    base = Pipeline.load(wide_heads_bundle, method="plain", threads=1)
    long_turns = [t * 3 for t in TURNS]  # answers decoded across the key-count boundaries (129 and 145 here)
    for method in ("pld", "lookahead"):
        ref = session(base, True, long_turns, chat=False)
        got = session(base.with_method(method), True, long_turns, chat=False)
        assert [r.token_ids for r in got] == [r.token_ids for r in ref]
        assert got[-1].stats.reused_tokens > 160 and sum(r.stats.accepted for r in got) > 0
    base.close()
