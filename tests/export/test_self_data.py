"""Training data without a dataset: prompts the chat model writes itself, answers generated in batches."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_edge.errors import ExportError
from specdec_edge.export import self_data
from tests.tiny_models import CHAT_REQUESTS


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval(), AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_user_turn_prefix_is_the_template_up_to_the_request(tiny):
    _, tok = tiny
    prefix = tok.decode(self_data.user_turn_prefix(tok))
    assert prefix == "<|im_start|>user\n"
    full = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert full.startswith(prefix)


def test_a_base_model_cannot_write_prompts(base_gemma_dir):
    from transformers import AutoTokenizer

    with pytest.raises(ExportError, match="--prompts"):
        self_data.user_turn_prefix(AutoTokenizer.from_pretrained(base_gemma_dir))


@pytest.mark.parametrize(
    "text,reason",
    [
        ("hi", "short"),
        ("word " * 200, "long"),
        ("Tell me <|im_start|> more about it", "markup"),
        ("!!! ??? ### 123 456 *** ^^^ %%%", "symbols"),
        ("Tell me \ufffd\ufffd about it", "undecodable"),
        ("Tell me\x1f more about it", "undecodable"),
        ("Write a poem about the sea and the sky", None),
        ("write a POEM about the sea  and the sky", "duplicate"),
    ],
)
def test_drop_reasons(text, reason):
    seen = {"write a poem about the sea and the sky"} if reason == "duplicate" else set()
    ids = list(range(len(text.split())))  # distinct: not repetitive
    assert self_data.drop_reason(text, ids, min_words=3, max_words=120, seen=seen) == reason


def test_a_looping_request_is_repetitive():
    ids = [5, 6, 7, 8] * 10
    assert self_data.drop_reason("please tell me more " * 10, ids, min_words=3, max_words=120, seen=set()) == (
        "repetitive"
    )


def test_generated_prompts_are_filtered_counted_and_reproducible(tiny):
    model, tok = tiny
    runs = [self_data.generate_prompts(model, tok, 6, seed=3, batch=8, max_tokens=24, progress=False) for _ in "ab"]
    a, b = runs
    assert a.prompts == b.prompts and a.dropped == b.dropped
    assert a.sampled == len(a.prompts) + sum(a.dropped.values())  # every sample is kept or has a reason
    assert len(a.prompts) <= 6 and len(set(a.prompts)) == len(a.prompts)
    seen = set()
    for p in a.prompts:  # what was kept passes the filter again
        ids = tok(p, add_special_tokens=False)["input_ids"]
        assert self_data.drop_reason(p, ids, min_words=3, max_words=120, seen=seen) in (None, "repetitive")
        seen.add(" ".join(w.lower() for w in p.split()))
    other = self_data.generate_prompts(model, tok, 6, seed=4, batch=8, max_tokens=24, progress=False)
    assert other.sampled and (other.prompts != a.prompts or other.dropped != a.dropped)
    assert a.summary()["sampled"] == a.sampled


def test_batched_answers_equal_the_runtimes_answers_and_features(tmp_path, tiny_llama_dir, tiny):
    """The torch batch path gives what the runtime's FeatureTap collects: the same greedy tokens and features."""
    from specdec_edge.api.pipeline import Pipeline
    from specdec_edge.export.draft_data import _answer, prepare_bundle
    from tests.speculative.test_methods import many_prompts

    model, tok = tiny
    bundle = prepare_bundle(str(tiny_llama_dir), tmp_path, 256, progress=False, layers=True)
    from specdec_edge.bundle.manifest import read_manifest

    layers = tuple(read_manifest(bundle).target.graph.feature_layers)
    texts = [p for p in many_prompts(12, seed=5) if isinstance(p, str)][:7]
    with Pipeline.load(bundle, method="plain", threads=1) as pipe:
        ref, width = _answer(pipe, texts, 20)
    got = self_data.generate_answers(
        model, tok, texts, answer_tokens=20, capacity=256, feature_layers=layers, batch=3, progress=False
    )
    assert len(got) == len(ref) == len(texts)
    for (ids, feats, start, lf), (rids, rfeats, rstart, rlf) in zip(got, ref):
        assert start == rstart
        np.testing.assert_array_equal(ids, rids)
        assert feats.shape == rfeats.shape == (len(ids), width)
        np.testing.assert_allclose(feats.astype(np.float32), rfeats.astype(np.float32), atol=2e-2, rtol=2e-2)
        np.testing.assert_allclose(lf.astype(np.float32), rlf.astype(np.float32), atol=2e-2, rtol=2e-2)


def test_prompts_that_do_not_fit_are_left_out(tiny):
    model, tok = tiny
    got = self_data.generate_answers(
        model, tok, ["short one", "word " * 80], answer_tokens=8, capacity=40, batch=4, progress=False
    )
    assert len(got) == 1 and got[0][2] == len(self_data.encode_prompt(tok, "short one"))


def test_a_chat_model_writes_requests_like_those_it_learned(chatty_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(chatty_dir).eval(), AutoTokenizer.from_pretrained(chatty_dir)
    report = self_data.generate_prompts(model, tok, 6, seed=0, batch=8, max_tokens=24, progress=False)
    assert len(report.prompts) >= 3, report.summary()
    learned = {w.strip(".") for r in CHAT_REQUESTS for w in r.split()}
    for p in report.prompts:
        assert set(w.strip(".") for w in p.split()) <= learned, p  # its own words, not bytes of noise


def test_train_draft_without_a_dataset(tmp_path, chatty_dir):
    """No --prompts: the target writes them (kept in OUT/prompts.jsonl, read back on a rerun), the PyTorch model
    answers them in batches, heads train on that; another seed's file is refused, a random model's noise too."""
    import json

    from specdec_edge.export.train_draft import train_draft
    from tests.tiny_models import TRAIN

    settings = dict(TRAIN, self_prompts=5, answer_batch=4, epochs=2)
    folder = train_draft("medusa", str(chatty_dir), tmp_path, **settings)
    lines = (tmp_path / "prompts.jsonl").read_text().splitlines()
    header, prompts = json.loads(lines[0]), [json.loads(ln)["turns"][0] for ln in lines[1:]]
    assert header["self_written_prompts"] == 5 and 1 <= len(prompts) <= 5
    training = json.loads((folder / "config.json").read_text())["training"]
    assert training["prompts"] == len(prompts) and training["answers"] == "PyTorch, batches of 4"
    assert training["prompts_file"].startswith("written by the target")
    before = (tmp_path / "prompts.jsonl").stat().st_mtime_ns
    train_draft("medusa", str(chatty_dir), tmp_path, **settings)  # a rerun reads them back
    assert (tmp_path / "prompts.jsonl").stat().st_mtime_ns == before
    with pytest.raises(ExportError, match="other settings"):
        train_draft("medusa", str(chatty_dir), tmp_path, **dict(settings, seed=1))


def test_a_model_that_writes_noise_is_told_to_give_prompts(tmp_path, tiny_llama_dir):
    from specdec_edge.export.train_draft import train_draft
    from tests.tiny_models import TRAIN

    with pytest.raises(ExportError, match="--prompts"):
        train_draft("medusa", str(tiny_llama_dir), tmp_path, **dict(TRAIN, self_prompts=2, answer_batch=4))


def test_a_bundle_target_needs_prompts(tmp_path, tiny_llama_dir):
    from specdec_edge.export.exporter import export_bundle
    from specdec_edge.export.train_draft import train_draft
    from tests.tiny_models import TRAIN

    bundle = export_bundle(str(tiny_llama_dir), tmp_path / "b", hidden_states=True, capacity=256, progress=False)
    with pytest.raises(ExportError, match="--prompts"):
        train_draft("medusa", str(bundle), tmp_path / "work", **TRAIN)
