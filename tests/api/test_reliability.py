"""Reliability of the Python API: no hang from a stream that is dropped, cancelled or read slowly, streams that
resume exactly after other calls used the engines, close() and the context manager, and the edges of text
(lone surrogates, a character cut by the length limit)."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from specdec_edge import Pipeline, SpecdecError
from specdec_edge.api.generation import LEASE_S, POLL_S
from specdec_edge.runtime.threads import OWN_SESSIONS

PROMPTS = ("The quick brown fox", "def add(a, b):", "Summarize the following article")


@pytest.fixture(scope="module")
def pipe(tiny_bundle):
    return Pipeline.load(tiny_bundle, threads=1)  # draft model: the engines hold two caches


@pytest.fixture(scope="module")
def expected(pipe):
    return {p: pipe.generate(p, max_new_tokens=40).token_ids for p in PROMPTS}


def within(seconds: float, fn, *args):
    """``fn(*args)`` in a daemon thread; fail (instead of hanging the suite) if it does not return in time."""
    out, errors = [], []

    def run():
        try:
            out.append(fn(*args))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {seconds} s (a hang)"
    if errors:
        raise errors[0]
    return out[0]


def test_a_stream_dropped_after_one_piece_does_not_block_the_next_call(pipe, expected):
    def scenario():
        stream = pipe.stream(PROMPTS[0], max_new_tokens=40)
        for _ in stream:
            break  # the reproduction: the stream is neither read to the end nor closed
        result = pipe.generate(PROMPTS[1], max_new_tokens=40)
        return stream, result

    stream, result = within(30, scenario)
    assert result.token_ids == expected[PROMPTS[1]]
    # The dropped stream is not lost: read again, it resumes from its own context and ends as if never interrupted.
    rest = within(30, lambda: list(stream))
    assert stream.result.token_ids == expected[PROMPTS[0]] and stream.result.finish_reason in ("length", "eos")
    assert rest and stream.result.text.endswith(rest[-1])


def test_cancel_then_generate_and_generate_from_another_thread(pipe, expected):
    stream = pipe.stream(PROMPTS[0], max_new_tokens=40)
    next(stream)
    stream.cancel()
    assert within(30, pipe.generate, PROMPTS[1], 40).token_ids == expected[PROMPTS[1]]
    assert list(stream) == [] and stream.result.finish_reason == "cancelled"

    # A stream abandoned in this thread holds a lease of LEASE_S at most against a call from another thread.
    held = pipe.stream(PROMPTS[2], max_new_tokens=40)
    next(held)
    assert within(30, pipe.generate, PROMPTS[0], 40).token_ids == expected[PROMPTS[0]]
    assert list(held) and held.result.token_ids == expected[PROMPTS[2]] and held.result.stats.resumes == 1


def test_cancel_frees_the_engines_at_once_and_reaches_a_waiting_reader(pipe, monkeypatch):
    stream = pipe.stream(PROMPTS[0], max_new_tokens=40)
    next(stream)
    other = pipe.stream(PROMPTS[1], max_new_tokens=40)
    threading.Thread(target=stream.cancel).start()
    assert within(30, next, other)  # gets the engines after the cancel, well within the suite's patience
    other.close()
    # A reader waiting for the engines while a generate holds them sees a cancel within a poll interval. The
    # generate's first target pass waits for ``release``, so the engines are held for as long as the test says.
    held, release, done = threading.Event(), threading.Event(), threading.Event()
    run = pipe.decoder.engine.run

    def held_run(*args, **kwargs):
        if threading.current_thread() is generating and not held.is_set():
            held.set()
            assert release.wait(60)
        return run(*args, **kwargs)

    def long_generate():
        pipe.generate(PROMPTS[2] * 3, max_new_tokens=120)
        done.set()

    monkeypatch.setattr(pipe.decoder.engine, "run", held_run)
    slow = pipe.stream(PROMPTS[2], max_new_tokens=40)
    generating = threading.Thread(target=long_generate, daemon=True)
    generating.start()
    assert held.wait(30)  # the generate is inside a step: the engines are in use
    pieces, errors = [], []

    def read():
        try:
            pieces.extend(slow)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(4 * POLL_S)  # time to start waiting; it cannot get the engines while the step holds them
    assert reader.is_alive() and not pieces, "a reader ran a step while another call's step held the engines"
    slow.cancel()
    reader.join(30)
    assert not reader.is_alive() and not errors, errors
    assert pieces == [] and slow.result.finish_reason == "cancelled"
    assert not done.is_set()  # the cancel reached the reader while the engines were still held
    release.set()
    assert done.wait(60)


def test_interleaved_streams_in_one_thread_give_the_same_tokens(pipe, expected):
    a, b = pipe.stream(PROMPTS[0], max_new_tokens=40), pipe.stream(PROMPTS[1], max_new_tokens=40)

    def alternate():  # every switch makes the other stream resume (prefill its context again)
        for _ in zip(a, b):
            pass
        return list(a) + list(b)

    within(60, alternate)
    assert a.result.token_ids == expected[PROMPTS[0]] and b.result.token_ids == expected[PROMPTS[1]]
    stats = a.result.stats
    assert stats.resumes >= 2 and stats.new_tokens == 40 and stats.prompt_tokens == len(pipe.encode(PROMPTS[0]))
    assert sum(stats.accepted_lengths.values()) == stats.steps and stats.new_tokens == stats.accepted + stats.steps


def test_a_slow_reader_loses_the_engines_and_resumes_exactly(pipe, expected):
    """A reader slower than the lease lets another thread's calls run in between; its tokens stay the same."""
    stream = pipe.stream(PROMPTS[2], max_new_tokens=40)
    stop = threading.Event()
    others = []

    def busy():
        while not stop.is_set():
            others.append(pipe.generate(PROMPTS[0], max_new_tokens=8).token_ids)

    worker = threading.Thread(target=busy, daemon=True)
    worker.start()
    pieces = []
    for piece in stream:
        pieces.append(piece)
        time.sleep(LEASE_S * 1.5)  # slower than the lease: the other thread takes the engines meanwhile
        if len(pieces) >= 4:
            break
    pieces += within(60, list, stream)
    stop.set()
    worker.join(30)
    assert stream.result.token_ids == expected[PROMPTS[2]] and "".join(pieces) == stream.result.text
    assert stream.result.stats.resumes >= 1
    assert others and all(ids == expected[PROMPTS[0]][:8] for ids in others)


def test_calls_take_turns_first_come_first_served(pipe, expected, monkeypatch):
    """Threads that call back to back cannot starve another thread's call: it waits for the calls that asked
    before it, not for whichever thread happens to grab the engines first. Counted under the lease's own lock
    (when a call first asks for the engines, and when a call ends), so that how a loaded machine schedules this
    test's threads between those moments does not enter the count."""
    lease = pipe.engines.lease
    asked, ended, caller = {}, [], {}  # generation -> calls ended when it first asked; ended, in order; its thread
    acquire, release = lease.acquire, lease.release

    def counted_acquire(gen, cancel):
        with lease.cond:  # re-entrant: the real acquire takes it again and waits on it
            asked.setdefault(gen, len(ended))
            caller.setdefault(gen, threading.get_ident())
        return acquire(gen, cancel)

    def counted_release(gen, keep, cancel):
        release(gen, keep, cancel)
        with lease.cond:
            if not keep and gen not in ended:
                ended.append(gen)

    monkeypatch.setattr(lease, "acquire", counted_acquire)
    monkeypatch.setattr(lease, "release", counted_release)
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            pipe.generate(PROMPTS[0], max_new_tokens=16)

    workers = [threading.Thread(target=busy, daemon=True) for _ in range(4)]
    for worker in workers:
        worker.start()
    while len(ended) < 8:
        time.sleep(0.01)
    for _ in range(5):
        assert within(60, pipe.generate, PROMPTS[1], 40).token_ids == expected[PROMPTS[1]]
    stop.set()
    for worker in workers:
        worker.join(60)
    busy_threads = {w.ident for w in workers}
    mine = [g for g in ended if caller[g] not in busy_threads]
    assert len(mine) == 5
    served = [ended.index(g) - asked[g] for g in mine]  # calls that ended between our asking and our end
    # at most the calls that asked before ours (one per busy thread), and one more where a loaded machine kept
    # our call from its next step past its lease (generation.LEASE_S)
    assert max(served) <= len(workers) + 1, served


def test_close_frees_the_engines_and_ends_open_streams(tiny_bundle):
    gc.collect()
    before = len(OWN_SESSIONS)
    with Pipeline.load(tiny_bundle, threads=1) as pipe:
        other = pipe.with_method("pld")
        assert len(OWN_SESSIONS) == before + 2  # target and draft
        stream = pipe.stream("The quick", max_new_tokens=20)
        next(stream)
    assert pipe.closed and other.closed
    assert list(stream) == [] and stream.result.finish_reason == "cancelled"
    for call in (pipe.generate, other.stream, pipe.with_method):
        with pytest.raises(SpecdecError, match="closed"):
            call("plain")
    pipe.close()  # twice is fine
    del stream, other
    gc.collect()
    assert len(OWN_SESSIONS) == before, "the ONNX Runtime sessions were not freed"


def test_close_from_another_thread_waits_for_the_running_step(tiny_bundle):
    pipe = Pipeline.load(tiny_bundle, method="plain", threads=1)
    stream = pipe.stream("The quick", max_new_tokens=200)
    first = next(stream)
    closer = threading.Thread(target=pipe.close)
    closer.start()
    rest = within(30, list, stream)
    closer.join(30)
    assert not closer.is_alive() and pipe.closed
    assert stream.result.finish_reason == "cancelled" and "".join([first, *rest]) == stream.result.text


def test_text_leaves_out_a_character_cut_by_the_length_limit(tiny_bundle):
    plain = Pipeline.load(tiny_bundle, method="plain", threads=1)
    found = 0
    for prompt in ("héllo wörld", "日本語の", "naïve café 🙂", "emoji 🚀", "The quick"):
        ids = plain.generate(prompt, max_new_tokens=24).token_ids
        cuts = [n for n in range(1, len(ids)) if plain.tokenizer.decode(ids[:n]).endswith("\ufffd")]
        for n in cuts[:2]:
            result = plain.generate(prompt, max_new_tokens=n)
            assert result.finish_reason == "length" and result.token_ids == ids[:n]
            assert result.text == plain.tokenizer.decode(ids[:n]).rstrip("\ufffd")  # no replacement char at the end
            assert "".join(plain.stream(prompt, max_new_tokens=n)) == result.text
            found += 1
    assert found, "no cut character found: pick other prompts"


def test_lone_surrogates_and_bad_stop_values_are_clear_errors(pipe):
    with pytest.raises(SpecdecError, match=r"unpaired surrogate \(U\+D800\)"):
        pipe.generate("a\ud800b")
    with pytest.raises(SpecdecError, match="unpaired surrogate"):
        pipe.generate([{"role": "user", "content": "x\udfff"}])
    for stop in (3, [b"x"], {"a": 1}):
        with pytest.raises(SpecdecError, match="stop="):
            pipe.generate("hello", stop=stop)


def test_reports_are_written_whole_or_not_at_all(tmp_path):
    from specdec_edge.atomic import write_atomic

    path = tmp_path / "b.json"
    write_atomic(path, '{"old": 1}')

    def broken(tmp):
        with open(tmp, "w") as f:
            f.write('{"new": ')  # the run dies in the middle of writing
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, write=broken)
    assert path.read_text() == '{"old": 1}' and [p.name for p in tmp_path.iterdir()] == ["b.json"]


def guard_caches(pipe) -> list[str]:
    """Make every call that reads or writes the target's or the draft's cache check that this thread holds the
    engines' lease (as a step does); returns the list it fills with the calls that did not."""
    lease, outside = pipe.engines.lease, []

    def checked(call, name):
        def check(*args, **kw):
            if not (lease.running and lease.holder_thread == threading.get_ident()):
                outside.append(name)
            return call(*args, **kw)

        return check

    for engine in (pipe.engines.target, pipe.engines.draft):
        for name in ("run", "commit", "rollback", "reset", "restore"):
            setattr(engine, name, checked(getattr(engine, name), f"{type(engine).__name__}.{name}"))
    return outside


def test_measuring_step_costs_mid_stream_leaves_the_stream_exact(tiny_bundle, tmp_path, monkeypatch):
    """auto is built while a stream is half read, in the same thread and in another, where its step costs are not
    cached (a fresh cache root each time, as on first use or with a read-only cache): the measurement takes the
    engines' lease like any step, so the streams go on from their own context and give plain decoding's tokens.
    Every use of the caches, measuring, saving and loading a prefix included, happens under the lease."""
    pipe = Pipeline.load(tiny_bundle, method="plain", threads=1)
    prompt = "Count: 1, 2, 3, 4,"
    want = pipe.generate(prompt, max_new_tokens=40).text
    outside = guard_caches(pipe)
    fresh = iter(range(100))
    monkeypatch.setattr("specdec_edge.api.step_costs.cache_dir", lambda: tmp_path / f"cache-{next(fresh)}")

    stream = pipe.stream(prompt, max_new_tokens=40)
    pieces = [next(stream) for _ in range(5)]
    auto = pipe.with_method("auto")  # measures on the target and the draft, this thread holding the stream
    assert "".join(pieces + list(stream)) == want

    other, read = {}, threading.Event()

    def slow_reader():
        s = pipe.stream(prompt, max_new_tokens=40)
        text = next(s)
        read.set()
        for piece in s:
            text += piece
            time.sleep(LEASE_S * 1.5)  # the lease runs out between pieces: the measurement may take the engines
        other["text"] = text

    reader = threading.Thread(target=slow_reader)
    reader.start()
    assert read.wait(60)
    auto = within(120, pipe.with_method, "auto")
    reader.join(120)
    assert other["text"] == want and auto.generate(prompt, max_new_tokens=40).text == want

    stream = pipe.stream(prompt, max_new_tokens=40)
    pieces = [next(stream) for _ in range(5)]
    pipe.load_prefix(pipe.save_prefix(tmp_path / "prefix.kv", "Another prompt, saved and loaded mid-stream"))
    assert "".join(pieces + list(stream)) == want
    assert outside == [], sorted(set(outside))


SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 3}


@pytest.mark.parametrize("method, sampling", [("plain", {}), ("pld", {}), ("plain", SEEDED), ("pld", SEEDED)])
def test_a_resumed_call_goes_on_from_what_its_own_decoding_wrote(int4_bundle, method, sampling):
    """Where prefill computes K/V another way than decoding (here the bundle's prefill graph: fp32 activations,
    against the 4-bit target's int8 ones), a call that loses the engines to another call and resumes must not
    prefill what it generated so far: its prompt is prefilled as before, and its own tokens are fed again through
    decode passes, so it ends as if never interrupted (greedy: the same tokens; seeded sampling: the same draws).
    With no KV reuse and no prompt cache nothing else keeps them."""
    from tests.runtime.prefill_checks import LONG

    pipe = Pipeline.load(int4_bundle, method=method, prefill="fp32", reuse=False, prompt_cache_mb=0, threads=1)
    assert len(pipe.encode(LONG)) > 64  # the prompt goes through the prefill graph
    alone = pipe.generate(LONG, max_new_tokens=40, **sampling).token_ids
    for after in (3, 12):  # interrupted early and late: a resumed context of 64+ tokens either way

        def interrupted(after=after):
            stream = pipe.stream(LONG, max_new_tokens=40, **sampling)
            for _ in stream:
                if len(stream.result.token_ids) >= after:  # tokens, not text pieces (a piece may hold several)
                    break
            pipe.generate(PROMPTS[0], max_new_tokens=8)  # takes the engines: the stream must resume
            return stream, list(stream)

        stream, _ = within(60, interrupted)
        assert stream.result.stats.resumes == 1
        assert stream.result.token_ids == alone, (method, sampling, after)
