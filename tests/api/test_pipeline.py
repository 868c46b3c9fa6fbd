"""The Python API: generate/stream, chat messages, stop strings, errors, threads, cancellation."""

from __future__ import annotations

import threading

import pytest

from specdec_edge import Pipeline, SpecdecError
from specdec_edge.api.streaming import StopFilter

MESSAGES = [{"role": "user", "content": "Summarize the following article in three sentences."}]


@pytest.fixture(scope="module")
def pipe(tiny_bundle):
    return Pipeline.load(tiny_bundle, method="draft", threads=1)


@pytest.fixture(scope="module")
def plain(tiny_bundle):
    return Pipeline.load(tiny_bundle, method="plain", threads=1)


def test_load_defaults_and_errors(pipe, tiny_bundle, tmp_path):
    assert pipe.k == 4 and pipe.engines.capacity == 255  # 256 minus the padding slot
    default = Pipeline.load(tiny_bundle, threads=1)
    assert default.method == "auto" and default.k == 10
    with pytest.raises(SpecdecError, match="unknown method"):
        Pipeline.load(tiny_bundle, method="jacobi")
    with pytest.raises(SpecdecError, match="speculation length"):
        Pipeline.load(tiny_bundle, k=0)
    with pytest.raises(SpecdecError, match="does not exist"):
        Pipeline.load(tmp_path / "nope")


def test_generate_matches_plain_and_streams_the_same_text(pipe, plain):
    for prompt in ["The quick brown fox", "def add(a, b):", MESSAGES, "héllo wörld 🙂"]:
        spec, ref = pipe.generate(prompt, max_new_tokens=30), plain.generate(prompt, max_new_tokens=30)
        assert spec.token_ids == ref.token_ids and spec.text == ref.text
        full = pipe.tokenizer.decode(spec.token_ids)  # a character cut by the length limit is left out of the text
        assert spec.text == (full if spec.finish_reason == "eos" else full.rstrip("\ufffd"))
        assert spec.finish_reason in ("eos", "length") and spec.stats.new_tokens >= len(spec.token_ids)
        assert "".join(pipe.stream(prompt, max_new_tokens=30)) == spec.text
        assert ref.stats.tokens_per_pass == 1.0


def test_messages_use_the_chat_template(pipe):
    ids = pipe.encode(MESSAGES)
    assert pipe.tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>user\n")
    assert ids.count(pipe.tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]) == 2  # no extra BOS


def test_sampling_is_seeded(pipe):
    a = pipe.generate("The quick", max_new_tokens=20, temperature=0.9, top_p=0.9, seed=5)
    b = pipe.generate("The quick", max_new_tokens=20, temperature=0.9, top_p=0.9, seed=5)
    assert a.token_ids == b.token_ids


def test_stop_string_is_cut_even_across_chunks(plain):
    full = plain.generate("The quick brown fox", max_new_tokens=40)
    stop = full.text[10:14]  # spans several tokens, emitted one token per step by plain decoding
    first = full.text.find(stop)
    res = plain.generate("The quick brown fox", max_new_tokens=40, stop=[stop, "never-there"])
    assert res.finish_reason == "stop" and res.text == full.text[:first]
    assert "".join(plain.stream("The quick brown fox", max_new_tokens=40, stop=stop)) == full.text[:first]


def test_stop_filter_holds_back_prefixes():
    f = StopFilter(["END"])
    assert f.feed("abcE") == ("abc", False)
    assert f.feed("N") == ("", False)
    assert f.feed("D tail") == ("", True)
    f = StopFilter(["END"])
    assert f.feed("xE") == ("x", False) and f.feed("y") == ("Ey", False) and f.flush() == ""


def test_too_long_prompt_is_a_clear_error(pipe):
    with pytest.raises(SpecdecError, match=r"exceeds the KV cache capacity of 255 tokens.*--capacity"):
        pipe.generate("fox " * 300, max_new_tokens=10)
    with pytest.raises(SpecdecError, match="max_new_tokens"):
        pipe.generate("fox", max_new_tokens=0)
    with pytest.raises(SpecdecError, match="temperature"):
        pipe.generate("fox", temperature=-1)


def test_closing_a_stream_releases_the_pipeline(pipe):
    stream = pipe.stream("The quick brown fox", max_new_tokens=50)
    next(stream)
    stream.close()
    assert stream.result.finish_reason == "cancelled" and stream.result.stats.new_tokens < 50
    assert pipe.generate("The quick brown fox", max_new_tokens=5).stats.new_tokens == 5


def test_cancel_from_another_thread(pipe):
    stream = pipe.stream("The quick brown fox", max_new_tokens=200)
    next(stream)
    threading.Thread(target=stream.cancel).start()
    rest = list(stream)
    assert stream.result.finish_reason == "cancelled" and len(rest) < 200


def test_threads_share_one_pipeline(pipe):
    expected = {p: pipe.generate(p, max_new_tokens=20).token_ids for p in ("a b", "The quick", "def add")}
    results, errors = [], []

    def work(prompt):
        try:
            results.append((prompt, pipe.generate(prompt, max_new_tokens=20).token_ids))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(p,)) for p in list(expected) * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 12
    assert all(ids == expected[p] for p, ids in results)


def test_stats_as_dict(pipe, plain):
    result = pipe.generate("The quick", max_new_tokens=12)
    d = result.stats.as_dict()
    assert d["new_tokens"] == 12 and d["prompt_tokens"] == len(pipe.encode("The quick"))
    assert 1 <= d["steps"] <= 12 and 0 <= d["accepted"] <= d["proposed"] <= pipe.k * d["steps"]
    assert sum(d["accepted_lengths"].values()) == d["steps"]
    assert sum(int(n) * c for n, c in d["accepted_lengths"].items()) == d["accepted"]
    assert d["new_tokens"] == d["accepted"] + d["steps"]  # each pass: its accepted drafts + the target's token
    assert d["tokens_per_pass"] == pytest.approx(12 / d["steps"])
    assert d["acceptance_rate"] == pytest.approx(d["accepted"] / d["proposed"])
    assert all(d[key] >= 0 for key in ("prefill_s", "draft_s", "verify_s", "other_s"))
    assert d["draft_s"] + d["verify_s"] + d["other_s"] == pytest.approx(d["decode_s"], abs=1e-6)
    assert d["prefill_s"] + d["decode_s"] == pytest.approx(d["total_s"])
    assert d["tokens_per_s"] == pytest.approx(12 / d["total_s"])
    ref = plain.generate("The quick", max_new_tokens=12).stats.as_dict()
    assert (ref["steps"], ref["proposed"], ref["accepted"], ref["tokens_per_pass"]) == (12, 0, 0, 1.0)


def test_stop_string_gives_the_same_tokens_with_and_without_speculation(tiny_self_bundle):
    spec = Pipeline.load(tiny_self_bundle, threads=1)  # every proposal accepted: 5 tokens per step
    plain = Pipeline.load(tiny_self_bundle, method="plain", threads=1)
    full = plain.generate("The quick brown fox", max_new_tokens=40)
    stop = full.text[12:15]
    a = spec.generate("The quick brown fox", max_new_tokens=40, stop=stop)
    b = plain.generate("The quick brown fox", max_new_tokens=40, stop=stop)
    assert a.finish_reason == b.finish_reason == "stop"
    assert (a.text, a.token_ids) == (b.text, b.token_ids) and len(a.token_ids) < len(full.token_ids)
    assert spec.tokenizer.decode(a.token_ids).startswith(a.text + stop)


def test_unavailable_provider_is_a_clear_error(tiny_bundle):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA; the error path needs a CPU-only build")
    with pytest.raises(SpecdecError, match="CUDAExecutionProvider is not available"):
        Pipeline.load(tiny_bundle, provider="cuda")
    with pytest.raises(SpecdecError, match="unknown provider"):
        Pipeline.load(tiny_bundle, provider="tpu")
