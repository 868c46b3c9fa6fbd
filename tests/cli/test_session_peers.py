"""benchmarks/session_peers.py: the parts that run without a peer -- how a continued generator serves a turn,
the turn assembly every runtime shares (``sessions.play``), the comparison of turns, and the merged report
(real ``run_sessions`` reports of the tiny bundle, a second "bundle" replaying the first's requests)."""

from __future__ import annotations

import pytest

from benchmarks.session_peers import merge, peer_turn, same_turns, token_bound, turn_plan
from specdec_edge.bench.sessions import Session, play, sessions_markdown
from tests.cli.test_sessions import prompts, roomy_bundle  # noqa: F401 (a fixture)


def test_turn_plan_keeps_the_common_prefix_and_computes_the_last_token():
    assert turn_plan([], [5, 6, 7]) == (0, [5, 6, 7])
    assert turn_plan([1, 2, 3, 4], [1, 2, 3, 9, 10]) == (3, [9, 10])  # the cached answer differs from token 4 on
    assert turn_plan([1, 2, 3], [1, 2, 3, 4]) == (3, [4])  # a continuation
    assert turn_plan([1, 2, 3], [1, 2, 3]) == (2, [3])  # the same prompt: the pending token is computed again
    assert turn_plan([1, 2, 3, 4], [1, 2]) == (1, [2])  # a shorter prompt inside the cache
    assert turn_plan([9], [1, 2]) == (0, [1, 2])


def test_play_assembles_turns_as_every_runtime_sends_them():
    calls = []

    def call(request):
        calls.append(request)
        return len(calls), f"answer {len(calls)}"

    chat = Session("c", "document", ("first", "second", "third"), True, "sys")
    turns, sent = play(chat, call)
    assert turns == [1, 2, 3] and sent == calls
    assert sent[0] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "first"}]
    assert sent[2][1:] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer 1"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "answer 2"},
        {"role": "user", "content": "third"},
    ]
    calls.clear()
    agent = Session("a", "agent", ("step 1", "step 2"), False, "sys")
    _, sent = play(agent, call)  # fresh requests: no answer is carried
    assert [r[-1]["content"] for r in sent] == ["step 1", "step 2"] and all(len(r) == 2 for r in sent)
    calls.clear()
    given = [[{"role": "user", "content": "x"}], [{"role": "user", "content": "y"}]]
    _, sent = play(Session("g", "spec-bench", ("p", "q")), call, given)  # replayed as given, answers ignored
    assert sent == given == calls


def test_peer_turns_and_their_comparison():
    t = peer_turn([1, 2, 3], 3, first_s=0.5, wall_s=2.0, prompt=100, reused=60)
    assert (t.prefill_s, t.decode_s, t.decode_tokens_per_s) == (0.5, 1.5, 2.0)
    assert t.prefilled_tokens + t.reused_tokens == t.prompt_tokens - 1  # as ours count them
    u = peer_turn([1, 2, 4], 3, 0.5, 0.5, 100, 0)
    assert u.decode_tokens_per_s == 0.0
    assert same_turns([t, u], [t, t]) == [True, False]
    words = {1: "a", 2: "b", 3: "c", 4: "c ", 7: "ab"}
    text = lambda ids: "".join(words[i] for i in ids)  # noqa: E731
    other = peer_turn([7, 3], 2, 0.1, 0.2, 10, 0)  # other token ids, the same text
    assert same_turns([other, u], [t, t], text) == [True, True] and same_turns([other], [t]) == [False]


def test_token_bound_holds_the_longest_context():
    count = lambda text: len(text.split())  # noqa: E731
    chat = Session("c", "document", ("a b c", "d e", "f"), True, "s t")
    bound = token_bound(chat, count, 10)
    assert bound >= 6 + 2 + 3 * 10  # every turn's text, the system message and three answers
    agent = Session("a", "agent", ("a", "a b", "a b c d"), False)
    assert 4 + 10 <= token_bound(agent, count, 10) < bound  # one request at a time


def test_merged_report_of_two_bundles_and_a_peer(roomy_bundle, tmp_path):  # noqa: F811
    from specdec_edge.api.pipeline import Pipeline
    from specdec_edge.bench.sessions import build_sessions, run_sessions, session_result

    session = next(s for s in build_sessions(prompts(tmp_path), n=1) if s.kind == "spec-bench")
    kw = dict(modes=["none", "reuse"], max_new_tokens=3, progress=False)
    with Pipeline.load(roomy_bundle, method="plain", threads=1, history=False) as pipe:
        base = run_sessions(pipe, ["plain"], [session], **kw)
        again = run_sessions(pipe, ["plain"], [session], requests=base["requests"], **kw)
    reference = base["results"]["plain none"][session.name]["turns"]
    peer = [peer_turn(t["token_ids"], t["new_tokens"], 0.1, 0.3, t["prompt_tokens"], 0) for t in reference]
    peer_rows = {"peer none": {session.name: session_result(peer, same_turns(peer, peer))}}
    slow = [peer_turn([0], 1, 0.05, 0.2, p.prompt_tokens, 1) for p in peer]
    peer_rows["peer reuse"] = {session.name: session_result(slow, same_turns(slow, peer))}
    meta = {**base["meta"], "peers": {"peer": "a test peer"}}
    report = merge([("", base), ("b/", again)], peer_rows, {"peer reuse": "peer none"}, meta)
    rows = ["plain none", "plain reuse", "b/plain none", "b/plain reuse", "peer none", "peer reuse"]
    assert report["meta"]["rows"] == rows
    assert report["meta"]["compared_with"]["b/plain reuse"] == "b/plain none"
    assert [s["name"] for s in report["sessions"]] == [session.name] and report["requests"] == base["requests"]
    summary = report["summary"]
    assert summary["b/plain reuse"]["spec-bench"]["identical_turns"] == 2  # the second bundle's own plain
    assert summary["peer reuse"]["spec-bench"]["first_later_vs_no_reuse"] == pytest.approx(0.5)  # vs peer none
    assert summary["peer none"]["spec-bench"]["total_s"] == pytest.approx(0.6)
    table = sessions_markdown(report)
    assert "| spec-bench (1) | peer reuse |" in table and "| spec-bench (1) | b/plain none |" in table
    assert f"DIVERGENCE: peer reuse differs from peer none on {session.name} turn(s) [1, 2]." in table
