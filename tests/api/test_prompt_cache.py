"""The prompt cache: LRU host-memory snapshots of earlier contexts, and prefix files.

Invariants: the store never holds more bytes than its limit and evicts the least recently used first; a call
that switches back to an earlier context restores its snapshot, and the output and the K/V equal a fresh
prefill's on these batch-invariant bundles (for plain, the draft model and methods that read the target's
features); a prefix file starts a new process with its context, and a file for another bundle or a damaged one
is refused.
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec_edge import Pipeline, SpecdecError
from specdec_edge.api.prompt_cache import MAGIC, PromptCache, Snapshot

DOC_A = "The quick brown fox jumps over the lazy dog. " * 6 + "What does the fox do?"
DOC_B = "Speculative decoding proposes tokens and verifies them in one pass. " * 5 + "What is verified?"


def snap(tokens, nbytes: int) -> Snapshot:
    return Snapshot(list(tokens), np.zeros((1, 2, 1, 1, len(tokens), nbytes // (8 * len(tokens))), np.float32))


def test_the_limit_is_never_exceeded_and_the_least_recently_used_goes_first():
    cache = PromptCache(limit_bytes=10_000)
    a, b, c = snap(range(10), 3000), snap(range(100, 110), 3000), snap(range(200, 210), 3000)
    for s in (a, b, c):
        assert cache.put(s) and cache.nbytes <= cache.limit
    assert cache.best([0, 1, 2, 9])[0] is a  # a is now the most recently used: b goes first
    d = snap(range(300, 310), 3000)
    assert cache.put(d) and cache.nbytes <= cache.limit
    assert cache.snapshots() == [c, a, d] and cache.evicted == 1
    assert not cache.put(snap(range(400, 420), 20_000))  # larger than the limit alone: not stored, nothing lost
    assert cache.snapshots() == [c, a, d]
    longer = snap(range(12), 3000)  # covers a (a's tokens are its prefix): a is dropped, not evicted
    assert cache.put(longer) and a not in cache.snapshots() and cache.evicted == 1
    assert cache.best(list(range(5)))[1] == 5 and cache.best([999])[0] is None


@pytest.fixture(scope="module")
def plain(tiny_bundle):
    return Pipeline.load(tiny_bundle, method="plain", threads=1, prompt_cache_mb=64)


def switch(pipe, n: int = 16, **gen):
    """A, B, then A again (its snapshot restored): the three results."""
    return [pipe.generate(doc, max_new_tokens=n, **gen) for doc in (DOC_A, DOC_B, DOC_A)]


def test_switching_back_restores_the_snapshot_and_equals_a_fresh_prefill(plain):
    engine = plain.engines.target
    fresh = plain.generate(DOC_A, max_new_tokens=16, reuse=False)
    want_kv = engine.cache[..., : engine.length, :].copy()
    a, b, again = switch(plain)
    assert b.stats.restored_tokens == 0 and again.stats.restored_tokens > len(plain.encode(DOC_A)) // 2
    assert again.stats.reused_tokens == again.stats.prompt_tokens - 1 and again.stats.prefilled_tokens == 0
    assert again.token_ids == a.token_ids == fresh.token_ids
    # the restored cache holds A's prompt and answer: its prompt slots are a fresh prefill's bits
    n = len(plain.encode(DOC_A)) - 1
    np.testing.assert_array_equal(engine.cache[..., :n, :], want_kv[..., :n, :])
    cache = plain.engines.prompt_cache
    assert cache.nbytes <= cache.limit and cache.restored >= 1
    off = plain.generate(DOC_B, max_new_tokens=16, reuse=False)  # no reuse: nothing restored nor kept
    assert off.stats.restored_tokens == 0 and off.token_ids == b.token_ids


@pytest.mark.parametrize(
    "fixture,method", [("tiny_self_bundle", "draft"), ("heads_bundle", "eagle"), ("heads_bundle", "pld-eagle")]
)
def test_restore_keeps_every_method_equal_to_plain(request, fixture, method):
    base = Pipeline.load(request.getfixturevalue(fixture), method="plain", threads=1, prompt_cache_mb=64)
    pipe = base.with_method(method)
    ref = [base.generate(doc, max_new_tokens=16, reuse=False) for doc in (DOC_A, DOC_B, DOC_A)]
    got = switch(pipe)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert got[2].stats.restored_tokens > 0 and sum(r.stats.accepted for r in got) > 0
    base.close()


@pytest.mark.parametrize("ping_pong", [False, True])
def test_gpu_engines_take_snapshots_through_their_slot_graphs(tiny_bundle, plain, ping_pong):
    """The CUDA/TensorRT EP engine's code on the CPU (its device cache an OrtValue; ping-pong: two slabs, as on
    the TensorRT EP): snapshots and restores go through its read/write graphs and switching back restores."""
    from specdec_edge.api.engines import Engines
    from specdec_edge.bundle.manifest import read_manifest
    from specdec_edge.runtime.base import GpuOptions
    from specdec_edge.runtime.ort_gpu_engine import OrtGpuEngine

    graph = read_manifest(tiny_bundle).target.graph
    gpu = GpuOptions(pad_to=4, ping_pong=ping_pong)
    engine = OrtGpuEngine(tiny_bundle / graph.path, graph, provider="cpu", device="cpu", threads=1, gpu=gpu)
    assert engine.can_snapshot and not isinstance(engine.cache, np.ndarray)
    engines = Engines(engine, verdict=plain.engines.verdict, prompt_cache=PromptCache(64 * 2**20))
    pipe = Pipeline(plain.tokenizer, engines, "plain")
    want = [pipe.generate(doc, max_new_tokens=16, reuse=False) for doc in (DOC_A, DOC_B)]
    a_kv = pipe.generate(DOC_A, max_new_tokens=16, reuse=False) and engine.snapshot()
    got = switch(pipe)
    assert [r.token_ids for r in got] == [want[0].token_ids, want[1].token_ids, want[0].token_ids]
    assert got[2].stats.restored_tokens > len(pipe.encode(DOC_A)) // 2 and got[2].stats.prefilled_tokens == 0
    n = len(pipe.encode(DOC_A)) - 1  # the restored prompt slots hold a fresh prefill's bits
    np.testing.assert_array_equal(engine.snapshot()[..., :n, :], a_kv[..., :n, :])
    with pytest.raises(SpecdecError, match="does not fit"):
        engine.restore(a_kv[:, :1], pipe.encode(DOC_A)[:4])


def test_a_small_limit_holds_what_fits(tiny_bundle, plain):
    per_token = plain.engines.target.cache[..., :1, :].nbytes + 8
    sizes = sorted(per_token * (len(plain.encode(doc)) + 15) / 2**20 for doc in (DOC_A, DOC_B))  # MB: prompt, answer
    pipe = Pipeline.load(tiny_bundle, method="plain", threads=1, prompt_cache_mb=sizes[1] + sizes[0] / 2)  # one
    results = switch(pipe)  # B evicts A's snapshot to be kept, but A was chosen first and is restored
    cache = pipe.engines.prompt_cache
    assert results[2].stats.restored_tokens > 0 and len(cache) == 1 and cache.nbytes <= cache.limit
    assert cache.snapshots()[0].tokens[: len(pipe.encode(DOC_B))] == pipe.encode(DOC_B)
    tiny = Pipeline.load(tiny_bundle, method="plain", threads=1, prompt_cache_mb=sizes[0] / 2)  # nothing fits
    assert switch(tiny)[2].stats.restored_tokens == 0 and len(tiny.engines.prompt_cache) == 0
    assert Pipeline.load(tiny_bundle, method="plain", threads=1, prompt_cache_mb=0).engines.prompt_cache is None
    with pytest.raises(SpecdecError, match="prompt_cache_mb=-1 is invalid"):
        Pipeline.load(tiny_bundle, method="plain", prompt_cache_mb=-1)


def test_a_prefix_file_starts_a_new_process_with_its_context(tiny_bundle, plain, tmp_path):
    system = [{"role": "system", "content": DOC_A}]
    path = plain.save_prefix(tmp_path / "system.prefix", system)
    assert path.read_bytes().startswith(MAGIC) and not list(tmp_path.glob(".*"))  # written whole, atomically
    messages = [*system, {"role": "user", "content": "And the dog?"}]
    want = plain.generate(messages, max_new_tokens=16, reuse=False)
    other = Pipeline.load(tiny_bundle, method="pld", threads=1)  # a new process, as it were
    n = other.load_prefix(path)
    assert len(plain.encode(DOC_A)) < n < len(plain.encode(system))  # the system turn, not the assistant's start
    got = other.generate(messages, max_new_tokens=16)
    assert got.token_ids == want.token_ids and got.stats.reused_tokens == n
    other.close()


def test_a_prefix_file_for_another_bundle_or_damaged_is_refused(plain, tiny_self_bundle, tmp_path):
    path = plain.save_prefix(tmp_path / "a.prefix", DOC_A)
    other = Pipeline.load(tiny_self_bundle, method="plain", threads=1)
    with pytest.raises(SpecdecError, match="saved for another bundle"):
        other.load_prefix(path)
    data = path.read_bytes()
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    for name, content in (("flipped", bytes(flipped)), ("short", data[:-100]), ("magic", b"x" + data[1:])):
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(SpecdecError, match="damaged") as e:
            plain.load_prefix(bad)
        assert "save it again" in str(e.value)
    with pytest.raises(SpecdecError, match="cannot read prefix file"):
        plain.load_prefix(tmp_path / "missing.prefix")
    other.close()


@pytest.mark.parametrize("cache_mb", [64, 0])
@pytest.mark.parametrize("method", ["plain", "draft"])
def test_calls_reuse_and_restore_only_their_own_owners_contexts(tiny_bundle, cache_mb, method):
    """Owner B sends the start of what owner A sent (a guess at A's text): B reuses, restores and prefills as if
    A's call never happened (``reused_tokens`` 0), and gets the same tokens as on fresh engines; A then goes on
    with its own context (restored from the prompt cache where there is one). Output is the same throughout."""
    pipe = Pipeline.load(tiny_bundle, method=method, threads=1, prompt_cache_mb=cache_mb)
    secret = DOC_A + " The PIN is 4821."
    fresh = {p: pipe.generate(p, max_new_tokens=8, reuse=False) for p in (secret, DOC_A + " The PIN is 4")}
    a = pipe.generate(secret, max_new_tokens=8, owner="A")
    guesses = [pipe.generate(DOC_A + " The PIN is 4", max_new_tokens=8, owner="B") for _ in range(2)]
    again = pipe.generate(secret, max_new_tokens=8, owner="A")
    assert guesses[0].stats.reused_tokens == 0 and guesses[0].stats.restored_tokens == 0
    assert guesses[1].stats.reused_tokens > 0  # its own earlier call's context: reused
    assert [g.token_ids for g in guesses] == [fresh[DOC_A + " The PIN is 4"].token_ids] * 2
    assert a.token_ids == again.token_ids == fresh[secret].token_ids
    assert again.stats.reused_tokens == (len(pipe.encode(secret)) - 1 if cache_mb else 0)
    no_owner = pipe.generate(secret, max_new_tokens=8)  # the API's own calls are one owner, not A: at most its own
    assert no_owner.stats.reused_tokens < len(pipe.encode(secret)) - 1  # earlier context, never A's whole one


def rewrite_header(path, out, edit=None, raw: bytes | None = None):
    """A copy of prefix file ``path`` at ``out`` whose JSON header is ``edit(header)`` (or the bytes ``raw``), the
    arrays' bytes (and so their sha256) unchanged."""
    import json
    import struct

    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[len(MAGIC) : len(MAGIC) + 8])
    header = json.loads(data[len(MAGIC) + 8 : len(MAGIC) + 8 + size])
    if edit is not None:
        edit(header)
    head = raw if raw is not None else json.dumps(header).encode()
    out.write_bytes(MAGIC + struct.pack("<Q", len(head)) + head + data[len(MAGIC) + 8 + size :])
    return out


def _reshape(name, shape):
    return lambda h: h["arrays"][name].update(shape=shape(h["arrays"][name]["shape"]))


PREFIX_DAMAGE = {
    "infinite-shape": _reshape("kv", lambda s: [float("inf"), *s[1:]]),
    "infinite-offset": lambda h: h["arrays"]["kv"].update(offset=float("inf")),
    "nan-size": lambda h: h["arrays"]["kv"].update(nbytes=float("nan")),
    "huge-shape": _reshape("kv", lambda s: [2**62, 2**62, *s[2:]]),
    "kv-reshaped": _reshape("kv", lambda s: [*s[:3], s[3] * s[5], s[4], 1]),  # the same bytes, the same sha256
    "draft-kv-alone": lambda h: h.update(draft_tokens=None),
    "draft-tokens-alone": lambda h: h["arrays"].pop("draft_kv"),
    "nested": None,
}


@pytest.mark.parametrize("case", list(PREFIX_DAMAGE))
def test_a_prefix_file_whose_arrays_do_not_fit_is_refused_before_anything_is_restored(plain, tmp_path, case):
    """Header values beyond numbers (Infinity, NaN, 2^124 elements), a header nested 100,000 deep, arrays whose
    shape differs but whose bytes (and sha256) do not, draft K/V without their tokens: each is the project's one
    error, before the engines or the prompt cache change; the pipeline answers as before."""
    path = plain.save_prefix(tmp_path / "a.prefix", DOC_A)
    raw = b'{"format": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}" if case == "nested" else None
    bad = rewrite_header(path, tmp_path / f"{case}.prefix", PREFIX_DAMAGE[case], raw)
    want = plain.generate(DOC_B, max_new_tokens=8, reuse=False).token_ids
    stored = plain.engines.prompt_cache.snapshots()
    with pytest.raises(SpecdecError, match="save it again with Pipeline.save_prefix") as e:
        plain.load_prefix(bad)
    assert str(bad) in str(e.value)
    assert plain.engines.prompt_cache.snapshots() == stored
    assert plain.generate(DOC_B, max_new_tokens=8).token_ids == want


def test_a_prefix_file_with_features_of_another_shape_never_reaches_eagle(heads_bundle, tmp_path):
    """EAGLE's features of the right bytes in the wrong shape, loaded through a plain pipeline (which restores no
    features, but stores them for the methods that read them), are refused at load: the prompt cache never holds
    them, and EAGLE on that prefix gives plain decoding's tokens."""
    plain = Pipeline.load(heads_bundle, method="plain", threads=1)
    eagle = plain.with_method("eagle")
    path = eagle.save_prefix(tmp_path / "doc.prefix", DOC_A)
    bad = rewrite_header(path, tmp_path / "wide.prefix", _reshape("features", lambda s: [s[0] * 2, s[1] // 2]))
    with pytest.raises(SpecdecError, match="features is .* these engines need"):
        plain.load_prefix(bad)
    assert not eagle.engines.prompt_cache.snapshots()
    want = eagle.with_method("plain").generate(DOC_A + " And?", max_new_tokens=12, reuse=False).token_ids
    assert eagle.generate(DOC_A + " And?", max_new_tokens=12).token_ids == want
    assert eagle.load_prefix(path) > 0 and eagle.generate(DOC_A + " And?", max_new_tokens=12).token_ids == want


def test_prefix_files_work_without_a_prompt_cache_and_say_what_is_missing_by_hand(tiny_bundle, tmp_path):
    """prompt_cache_mb=0 keeps no snapshots, but prefix files still save and load (into the live engines); engines
    built by hand without the bundle's digest are told exactly that, and how to give it."""
    from specdec_edge.api.engines import Engines
    from specdec_edge.bundle.hashes import manifest_digest

    first = Pipeline.load(tiny_bundle, method="plain", threads=1, prompt_cache_mb=0)
    path = first.save_prefix(tmp_path / "doc.prefix", DOC_A)
    want = first.generate(DOC_A + " And?", max_new_tokens=8, reuse=False).token_ids
    second = Pipeline.load(tiny_bundle, method="draft", threads=1, prompt_cache_mb=0)
    n = second.load_prefix(path)
    got = second.generate(DOC_A + " And?", max_new_tokens=8)
    assert got.token_ids == want and got.stats.reused_tokens == n > 0 and second.engines.prompt_cache is None
    by_hand = Pipeline(first.tokenizer, Engines(first.engines.target, verdict=first.engines.verdict), "plain")
    for call in (lambda: by_hand.save_prefix(tmp_path / "x.prefix", DOC_A), lambda: by_hand.load_prefix(path)):
        with pytest.raises(SpecdecError, match=r"built by hand \(Engines\(...\)\) without one: pass digest=") as e:
            call()
        assert "opened by hand" not in str(e.value)
    target, verdict = first.engines.target, first.engines.verdict
    keyed = Pipeline(first.tokenizer, Engines(target, verdict=verdict, digest=manifest_digest(tiny_bundle)), "plain")
    assert keyed.load_prefix(path) == n
