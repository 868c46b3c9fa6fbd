"""Drafting from history (``speculative/history.py``): the bounded store and its lookup, and the pipeline's
calls with it.

Invariants: a lookup proposes only what really followed a match of the context's suffix in an earlier
stream (checked against a brute-force search, with hash collisions made frequent), the longest match first;
the store's arrays never exceed its limit and the oldest text goes first; greedy output with history equals
plain decoding's over several calls (chat turns, repeated prompts) while history proposals are accepted;
sampling keeps the target's distribution (chi-square); seeded sampling does not draft from history; a call
with history off neither drafts from nor adds to it.
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec_edge import Pipeline, SpecdecError
from specdec_edge.sampling import SamplingParams, make_rng, probs_from_logits
from specdec_edge.speculative.history import HistoryProposer
from specdec_edge.speculative.history_store import _BYTES_PER_TOKEN, LEVELS, MAX_MATCH, MIN_TOKENS, HistoryStore
from specdec_edge.speculative.loop import decode, prefill
from specdec_edge.speculative.stats import Stats
from tests.speculative.test_acceptance import CHI2_CRIT_DF7_P001
from tests.speculative.test_methods import many_prompts


def store_of(tokens: int) -> HistoryStore:
    return HistoryStore(tokens * _BYTES_PER_TOKEN)


# ---- the store


def test_lookup_proposes_what_followed_the_longest_match():
    store = store_of(4096)
    doc = list(range(100, 300))
    store.add(doc)
    tokens, matched = store.lookup([7, 7, *doc[:50]], 5)
    assert tokens.tolist() == doc[50:55] and matched == 50
    # a later stream with a short match of the same tail does not hide the long one
    store.add([1, 2, doc[48], doc[49], 9, 9, 9])
    tokens, matched = store.lookup([7, 7, *doc[:50]], 5)
    assert tokens.tolist() == doc[50:55] and matched == 50
    # where only a short match exists, the most recent one
    tokens, matched = store.lookup([5, doc[48], doc[49]], 3)
    assert tokens.tolist() == [9, 9, 9] and matched == 2


def test_a_continuation_stops_at_the_end_of_its_stream_and_min_match():
    store = store_of(4096)
    store.add([1, 2, 3, 4, 5])
    store.add([50, 60, 70])
    tokens, matched = store.lookup([9, 2, 3, 4], 10)
    assert tokens.tolist() == [5] and matched == 3  # not into the next stream
    assert store.lookup([9, 2, 3, 4], 10, min_match=4)[0].tolist() == []
    assert store.lookup([4, 5], 3)[0].tolist() == []  # nothing followed 4, 5
    assert store.lookup([2, 3], 0)[0].tolist() == []


def test_a_call_that_extends_the_last_stream_adds_only_its_new_tokens():
    store = store_of(4096)
    turn1 = list(range(10, 60))
    store.add(turn1)
    held = store.held
    turn2 = turn1 + [5, 6, 7, 8]
    store.add(turn2)
    assert store.held == held + 4 and store.streams == 1
    # the n-grams across the old end were indexed: turn 1's last tokens are now followed by 5, 6, 7, 8
    assert store.lookup([1, 58, 59], 4)[0].tolist() == [5, 6, 7, 8]
    store.add(turn2)  # nothing new
    assert store.held == held + 4
    store.add([10, 11, 99])  # not an extension: a new stream
    assert store.streams == 2


def brute_force(streams, context, k):
    """Every (continuation, match length) a correct lookup may return: an occurrence of the context's last
    n tokens in an earlier stream, for n in LEVELS, followed by at least one token."""
    allowed = []
    for stream in streams:
        for n in LEVELS:
            if n > len(context):
                continue
            tail = context[-n:]
            for start in range(n, len(stream)):
                if stream[start - n : start] == tail:
                    length = n
                    while (
                        length < min(MAX_MATCH, start, len(context))
                        and stream[start - length - 1] == context[-length - 1]
                    ):
                        length += 1
                    allowed.append((tuple(stream[start : start + k]), length))
    return allowed


def test_lookups_are_real_matches_even_when_hashes_collide():
    """A store of 64 slots over a 6-token vocabulary: slots are shared all the time, text is evicted; every
    proposal must still be what followed a real match, with its true length."""
    rng = np.random.default_rng(0)
    store = store_of(MIN_TOKENS)
    held: list[list[int]] = []
    hits = 0
    for _ in range(300):
        stream = rng.integers(0, 6, int(rng.integers(3, 40))).tolist()
        store.add(stream)
        held.append(stream)
        context = rng.integers(0, 6, 30).tolist()
        tokens, matched = store.lookup(context, 6)
        if len(tokens):
            hits += 1
            # the store holds less than its capacity (64 tokens): a match can only be in a recent stream
            assert (tuple(tokens.tolist()), matched) in brute_force(held[-8:], context, 6)
    assert hits > 100


def test_the_limit_is_never_exceeded_and_the_oldest_text_goes_first():
    limit = 1 << 16
    store = HistoryStore(limit)
    assert store.nbytes <= limit and store.capacity == limit // _BYTES_PER_TOKEN
    rng = np.random.default_rng(1)
    first = rng.integers(1000, 2000, 300).tolist()
    store.add(first)
    assert store.lookup(first[:40], 4)[0].tolist() == first[40:44]
    sizes = set()
    for _ in range(400):
        store.add(rng.integers(0, 50000, int(rng.integers(1, 900))).tolist())
        assert store.nbytes <= limit and store.held <= store.capacity
        sizes.add(store.held)
    assert store.evicted > 0 and max(sizes) > 0.8 * store.capacity
    assert store.lookup(first[:40], 4)[0].tolist() == []  # evicted
    last = rng.integers(3000, 4000, 300).tolist()
    store.add(last)
    assert store.lookup(last[:40], 4)[0].tolist() == last[40:44]
    # a stream longer than the whole store keeps its end
    huge = rng.integers(5000, 9000, 3 * store.capacity).tolist()
    store.add(huge)
    assert store.nbytes <= limit and store.held <= store.capacity
    assert store.lookup(huge[-100:-50], 4)[0].tolist() == huge[-50:-46]


def test_text_seen_again_stays():
    """Least recently seen goes first: a document sent again with each call survives eviction."""
    store = store_of(2000)
    rng = np.random.default_rng(2)
    doc = rng.integers(1000, 2000, 200).tolist()
    for _ in range(60):
        store.add(doc + rng.integers(0, 50000, 80).tolist())
        store.add(rng.integers(0, 50000, 150).tolist())
    assert store.evicted > 5 * store.capacity
    assert store.lookup(doc[:30], 4)[0].tolist() == doc[30:34]


def test_bad_sizes_are_named():
    with pytest.raises(SpecdecError, match="too small"):
        HistoryStore(100)
    for bad in (0, -1, True, "16", float("nan")):
        with pytest.raises(SpecdecError, match="history_mb"):
            HistoryStore.of_mb(bad)


# ---- the pipeline


@pytest.fixture(scope="module")
def plain(tiny_bundle):
    return Pipeline.load(tiny_bundle, method="plain", threads=1)


def turns(pipe, prompts, history=True, **kw):
    """Chat-style calls: each prompt is the previous call's prompt + answer + the next text; their results."""
    results, text = [], ""
    for prompt in prompts:
        text += prompt
        result = pipe.generate(text, max_new_tokens=24, history=history, **kw)
        results.append(result)
        text += result.text
    return results


@pytest.mark.parametrize("method", ["history", "auto"])
def test_greedy_with_history_equals_plain_over_many_calls(plain, method):
    pipe = plain.with_method(method)
    pipe.history = HistoryStore()  # its own, empty
    store = pipe.history
    prompts = many_prompts(12)
    accepted = 0
    for round_ in range(2):  # the second round repeats the prompts: history knows every answer
        for prompt in prompts:
            ref = plain.generate(prompt, max_new_tokens=30, history=False)
            got = pipe.generate(prompt, max_new_tokens=30)
            assert got.token_ids == ref.token_ids, (method, round_, prompt)
            if round_:
                accepted += got.stats.by_proposer.get("history", Stats()).accepted
    chat = ["The quick brown fox. ", " And then? ", " Say it again: the quick brown fox. "]
    for ref, got in zip(turns(plain, chat, history=False), turns(pipe, chat)):
        assert got.token_ids == ref.token_ids
    assert store.streams > 0 and accepted > 50, f"history was accepted {accepted} times: the test proves little"


def test_history_sampling_keeps_the_target_distribution(plain):
    """First emitted token over many draws vs the target's exact top-8 distribution (chi-square, df 7), with
    the history store proposing the target's likeliest next token (and more) after the prompt."""
    params = SamplingParams(temperature=1.0, top_k=8)  # no seed: history is drafted from
    prompt = plain.encode("the quick brown fox jumps over")
    prefill(plain.engines.target, prompt[:-1])
    p = probs_from_logits(plain.engines.target.run(prompt[-1:]).logits, params)[0]
    support = np.flatnonzero(p)
    store = store_of(4096)
    store.add([*prompt, int(np.argmax(p)), 7, 8, 9])
    proposer = HistoryProposer(min_match=2)
    firsts, accepted, proposed = [], 0, 0
    for seed in range(1500):
        stats = Stats()
        step = next(
            decode(
                plain.engines.target,
                proposer,
                prompt,
                max_new_tokens=3,
                params=params,
                k=3,
                history=store,
                rng=make_rng(seed),
                stats=stats,
            )
        )
        firsts.append(step.tokens[0])
        accepted += stats.accepted
        proposed += stats.proposed
    counts = np.array([firsts.count(t) for t in support])
    assert counts.sum() == len(firsts) and len(support) == 8
    expected = p[support] * len(firsts)
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_CRIT_DF7_P001
    assert proposed == 2 * 1500 and accepted > 100, f"history accepted {accepted} times: the test would prove little"


def test_seeded_sampling_does_not_draft_from_history(plain):
    pipe = plain.with_method("history")
    pipe.history = HistoryStore()
    kw = dict(max_new_tokens=20, temperature=0.8, top_k=20, seed=3)
    a = pipe.generate("the quick brown fox jumps", **kw)
    b = pipe.generate("the quick brown fox jumps", **kw)  # history now holds a's text
    assert a.token_ids == b.token_ids and "history" not in b.stats.by_proposer


def test_history_off_drafts_from_nothing_and_adds_nothing(plain, tiny_bundle):
    pipe = plain.with_method("history")
    pipe.history = HistoryStore()
    prompt = "the quick brown fox jumps over the lazy dog"
    first = pipe.generate(prompt, max_new_tokens=20, history=False)
    assert pipe.history.held == 0
    again = pipe.generate(prompt, max_new_tokens=20)
    assert "history" not in again.stats.by_proposer and pipe.history.held > 0  # added now
    third = pipe.generate(prompt, max_new_tokens=20)
    assert third.stats.by_proposer["history"].accepted > 0
    assert first.token_ids == again.token_ids == third.token_ids
    with pytest.raises(SpecdecError, match="history=.*invalid"):
        pipe.generate(prompt, max_new_tokens=2, history="yes")
    off = Pipeline.load(tiny_bundle, method="auto", threads=1, history=False)
    try:
        assert off.history is None and off.new_history() is None
        off.generate(prompt, 8)
        assert "history" not in off.generate(prompt, 8).stats.by_proposer
    finally:
        off.close()
    with pytest.raises(SpecdecError, match="history_mb"):
        Pipeline.load(tiny_bundle, method="plain", history_mb=0)


def test_a_small_store_keeps_its_limit_through_the_pipeline(tiny_bundle):
    pipe = Pipeline.load(tiny_bundle, method="history", threads=1, history_mb=0.01)
    try:
        for prompt in many_prompts(20):
            pipe.generate(prompt, max_new_tokens=30)
            assert pipe.history.nbytes <= 0.01 * (1 << 20) and pipe.history.held <= pipe.history.capacity
        assert pipe.history.evicted > 0
    finally:
        pipe.close()


def test_history_larger_than_the_memory_available_is_refused_in_one_line(tiny_bundle, tmp_path):
    """A history store is taken from memory when it is first used, and a size (times the API keys, for the server)
    beyond the memory available now is refused before anything is allocated, with one line naming the fix; the
    API's keyword too, where a single store can exceed it here."""
    import math
    import subprocess
    import sys

    from specdec_edge.runtime.base import available_memory
    from specdec_edge.speculative.history import MAX_HISTORY_MB

    pipe = Pipeline.load(tiny_bundle, method="history", threads=1, history_mb=64)
    assert pipe.history.nbytes == 0  # nothing taken before a call adds to it
    pipe.generate("The quick brown fox", max_new_tokens=4)
    assert 0 < pipe.history.nbytes <= 64 << 20
    pipe.close()
    available_mb = available_memory() / 2**20
    keys = math.ceil(available_mb / 4096) + 1  # 4 GiB for each key: more than the machine has, together
    command = [sys.executable, "-c", "from specdec_edge.cli import main; main()", "serve", str(tiny_bundle),
               "--history-mb", "4096", *[a for i in range(keys) for a in ("--api-key", f"key-{i}")]]  # fmt: skip
    res = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"--history-mb 4096 MiB for each of {keys} API keys needs" in res.stderr and "--no-history" in res.stderr
    if available_mb < MAX_HISTORY_MB:
        with pytest.raises(SpecdecError, match=r"history_mb 65536 MiB needs 64.0 GiB .* give a smaller history_mb"):
            Pipeline.load(tiny_bundle, method="plain", history_mb=MAX_HISTORY_MB)
