"""The accumulating corpus: shards written by the bundle, continued by a rerun, refused by name when damaged or
foreign, kept apart from Spec-Bench; heads trained from it with the bundle's own features, checked per epoch."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

from specdec_edge.api.settings import LoadSettings
from specdec_edge.errors import ExportError
from specdec_edge.export import corpus as corpus_mod
from specdec_edge.export import openers
from specdec_edge.export.corpus import Corpus, CorpusSettings, NearDuplicates, grow, held_out

SETTINGS = CorpusSettings(per_shard=3, answer_tokens=12, request_tokens=48)  # the tiny tokenizer: ~1 token a character
ONE_THREAD = LoadSettings(threads=1)


def grow_one_more(bundle, folder) -> None:
    """One more shard of ``SETTINGS`` in ``folder``, written by ``bundle`` on one thread."""
    grow(bundle, folder, SETTINGS, answer_tokens_goal=10**6, max_shards=1, load=ONE_THREAD, log=lambda m: 0)


@pytest.fixture(scope="module")
def chatty_bundle(tmp_path_factory, chatty_dir):
    """The chatty tiny model with hidden states: it writes requests, answers them, and heads can read it."""
    from specdec_edge.export.exporter import export_bundle

    out = tmp_path_factory.mktemp("bundles") / "chatty"
    return export_bundle(str(chatty_dir), out, capacity=256, hidden_states=True, progress=False)


@pytest.fixture(scope="module")
def grown(tmp_path_factory, chatty_bundle):
    folder = tmp_path_factory.mktemp("corpus") / "c"
    grow(chatty_bundle, folder, SETTINGS, answer_tokens_goal=1, load=ONE_THREAD, log=lambda m: None)
    return folder


def test_a_shard_holds_the_bundles_requests_and_its_greedy_answers(grown, chatty_bundle):
    from specdec_edge.api.pipeline import Pipeline

    corpus = Corpus.read(grown)
    assert len(corpus.shards) == 1 and len(corpus.requests) == 3
    shard = corpus.shards[0]
    assert shard["counts"]["requests"] == 3 and shard["counts"]["sampled"] >= 3
    assert CorpusSettings(**shard["settings"]) == SETTINGS
    assert "openers" not in shard["settings"]  # a late field at its old value: shards written before it still agree
    with Pipeline.load(chatty_bundle, method="plain", threads=1) as pipe:
        for request, ids, answer in corpus.records(shard):
            messages = [{"role": "user", "content": request}]
            assert ids[:answer].tolist() == pipe.encode(messages)
            plain = pipe.generate(messages, SETTINGS.answer_tokens, reuse=False, history=False)
            eos = [min(pipe.tokenizer.eos_token_ids)] if plain.finish_reason == "eos" else []
            assert ids[answer:].tolist() == plain.token_ids + eos


def test_a_rerun_continues_after_the_last_whole_shard(tmp_path, grown, chatty_bundle):
    folder = tmp_path / "c"
    shutil.copytree(grown, folder)
    first = (folder / "shard-00000.ids").read_bytes()
    (folder / "shard-00001.ids").write_bytes(b"half a shard")  # interrupted before its manifest was written
    grow_one_more(chatty_bundle, folder)
    corpus = Corpus.read(folder)
    assert [s["shard"] for s in corpus.shards] == [0, 1]  # one more shard, the half one written again
    assert (folder / "shard-00000.ids").read_bytes() == first
    assert len(set(corpus.requests)) == len(corpus.requests) == 6  # no request twice
    assert corpus.shards[1]["seed"] == corpus_mod.shard_seed(SETTINGS.seed, 1)


def test_a_damaged_or_foreign_shard_is_refused_by_name(tmp_path, grown, chatty_bundle):
    folder = tmp_path / "c"
    shutil.copytree(grown, folder)
    with pytest.raises(ExportError, match=r"shard-00000.json is foreign.*answer_tokens=12 vs 13"):
        grow(chatty_bundle, folder, replace(SETTINGS, answer_tokens=13), answer_tokens_goal=1, log=lambda m: 0)
    ids = folder / "shard-00000.ids"
    ids.write_bytes(ids.read_bytes()[:-2] + b"\x01\x00")
    with pytest.raises(ExportError, match=r"shard-00000.ids is damaged.*delete"):
        Corpus.read(folder)
    (folder / "shard-00000.json").write_text("{not json")
    with pytest.raises(ExportError, match=r"shard-00000.json is damaged"):
        Corpus.read(folder)


def test_an_opener_set_starts_every_request_and_a_corpus_keeps_its_set(tmp_path, grown, chatty_bundle):
    folder = tmp_path / "tasks"
    tasks = replace(SETTINGS, openers="tasks")
    grow(chatty_bundle, folder, tasks, answer_tokens_goal=1, load=ONE_THREAD, log=lambda m: 0)
    shard = Corpus.read(folder).shards[0]
    assert shard["settings"]["openers"] == "tasks" and corpus_mod.report(Corpus.read(folder))["openers"] == "tasks"
    for record in shard["records"]:
        assert any(record["request"].startswith(o) for o in openers.TASKS), record["request"]
    seeds = range(shard["seed"], shard["seed"] + shard["counts"]["sampled"])
    assert {r["request"].split()[0] for r in shard["records"]} <= {openers.opener("tasks", s).split()[0] for s in seeds}
    with pytest.raises(ExportError, match=r"shard-00000.json is foreign.*openers='tasks' vs ''"):
        grow(chatty_bundle, folder, SETTINGS, answer_tokens_goal=10**6, max_shards=1, log=lambda m: 0)
    with pytest.raises(ExportError, match=r"foreign.*openers='' vs 'tasks'"):
        grow(chatty_bundle, grown, tasks, answer_tokens_goal=10**6, max_shards=1, log=lambda m: 0)


def test_openers_are_drawn_by_seed_and_an_unknown_set_is_named():
    assert openers.opener("", 5) == ""
    drawn = [openers.opener("tasks", s) for s in range(400)]
    assert drawn == [openers.opener("tasks", s) for s in range(400)] and len(set(drawn)) > 50
    with pytest.raises(ExportError, match=r"unknown opener set 'poems'.*'tasks'"):
        openers.opener("poems", 0)


def test_the_same_model_exported_anew_continues_the_corpus_and_another_model_is_refused(
    tmp_path, grown, chatty_dir, tiny_self_bundle
):
    """The corpus holds a model's answers, not one graph's bytes: a re-export whose graph differs (here with
    no hidden-states output) continues it, and each shard records the graph that wrote it."""
    from specdec_edge.export.exporter import export_bundle

    folder = tmp_path / "c"
    shutil.copytree(grown, folder)
    plainer = export_bundle(str(chatty_dir), tmp_path / "again", capacity=256, progress=False)
    grow_one_more(plainer, folder)
    corpus = Corpus.read(folder)
    assert len(corpus.shards) == 2 and corpus.shards[0]["identity"] == corpus.shards[1]["identity"]
    assert corpus.shards[0]["graph_digest"] != corpus.shards[1]["graph_digest"]
    with pytest.raises(ExportError, match=r"shard-00000.json is foreign: written by another model.*source"):
        grow(tiny_self_bundle, folder, SETTINGS, answer_tokens_goal=1, log=lambda m: 0)


def test_a_missing_shard_in_the_middle_is_named(tmp_path, grown):
    folder = tmp_path / "c"
    shutil.copytree(grown, folder)
    for ext in (".json", ".ids"):
        shutil.copy(folder / f"shard-00000{ext}", folder / f"shard-00002{ext}")
    data = json.loads((folder / "shard-00002.json").read_text())
    (folder / "shard-00002.json").write_text(json.dumps({**data, "shard": 2}))
    with pytest.raises(ExportError, match="shard 1 is missing"):
        Corpus.read(folder)


def test_spec_bench_prompts_and_near_copies_are_kept_out():
    filters = NearDuplicates()
    line = corpus_mod.SPEC_BENCH.read_text().splitlines()[100]
    prompt = json.loads(line)["turns"][0]
    assert filters.reason(prompt) == "benchmark"
    words = prompt.split()
    assert filters.reason(" ".join(words[:-1]) + " please.") == "benchmark"  # a light rewording
    assert filters.reason("How do I keep basil alive on a windowsill in winter?") is None
    filters.add("How do I keep basil alive on a windowsill in winter?")
    assert filters.reason("how do I keep basil  alive on a windowsill in winter") == "duplicate"


def test_held_out_requests_are_chosen_by_their_text():
    picked = [held_out(f"request number {i}") for i in range(5000)]
    assert 0.01 < np.mean(picked) < 0.03  # one in 50
    assert picked == [held_out(f"request number {i}") for i in range(5000)]


def test_heads_train_on_the_bundles_own_features_with_a_check_per_epoch(tmp_path, grown, chatty_bundle):
    """train-draft --corpus: the sequences fed through the bundle (features cached per shard, not recomputed on a
    rerun), a held-out check per epoch with the chain acceptance measured on the bundle."""
    from specdec_edge.api.pipeline import Pipeline
    from specdec_edge.export.train_draft import train_draft
    from specdec_edge.runtime.base import prefill
    from specdec_edge.speculative.features import FeatureTap
    from tests.tiny_models import TRAIN

    corpus = tmp_path / "c"
    shutil.copytree(grown, corpus)
    grow_one_more(chatty_bundle, corpus)
    settings = dict(TRAIN, epochs=2, corpus=corpus, eval_bundle=chatty_bundle, eval_prompts=2, threads=1)
    settings.update(held_out_every=3)  # a few of the 6 requests held out, so the check has prompts
    assert 0 < sum(held_out(r, 3) for r in Corpus.read(corpus).requests) < 6
    folder = train_draft("eagle", str(chatty_bundle), tmp_path / "work", **settings)
    rows = [json.loads(x) for x in (folder / "epochs.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2]
    for r in rows:
        check = r[chatty_bundle.name]
        assert 0 <= check["top1"] <= 1 and check["passes"] > 0 and 0 <= r["held_out_top1"] <= 1
        assert 0 <= r["held_out_answer_top1"] <= 1  # the answers' slots alone
        depths = [check["accepted_at_depth"][str(d)] for d in range(1, 5)]
        assert depths == sorted(depths) and depths[0] == pytest.approx(check["top1"], abs=1e-3)
    training = json.loads((folder / "config.json").read_text())["training"]
    assert training["prompts_file"] == "corpus c" and training["sequences"] >= 1
    cached = sorted((tmp_path / "work" / "corpus-features").glob("features-*.npz"))
    assert len(cached) == 2
    # the cached features are the bundle's own, computed by teacher forcing
    from specdec_edge.export.draft_data import _read_part

    seq = _read_part(cached[0])[0]
    with Pipeline.load(chatty_bundle, method="plain", threads=1) as pipe:
        tap = FeatureTap(pipe.engines.target)
        prefill(tap, seq["ids"].tolist())
        np.testing.assert_array_equal(tap.features[: len(seq["ids"])].astype(np.float16), seq["features"])
    before = [p.stat().st_mtime_ns for p in cached]
    train_draft("eagle", str(chatty_bundle), tmp_path / "work", **settings)
    assert [p.stat().st_mtime_ns for p in cached] == before


def test_the_command_reports_the_corpus_and_writes_its_table(tmp_path, grown):
    from click.testing import CliRunner

    from specdec_edge.cli import main
    from specdec_edge.speculative.table import NgramTable

    result = CliRunner().invoke(main, ["corpus", str(grown), "--report"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["requests"] == 3 and summary["shards"] == 1 and sum(summary["topics"].values()) == 3
    assert summary["openers"].startswith("none")
    result = CliRunner().invoke(main, ["corpus", str(grown), "--table", str(tmp_path / "t.npz"), "--min-count", "1"])
    assert result.exit_code == 0, result.output
    table = NgramTable.load(tmp_path / "t.npz")
    corpus = Corpus.read(grown)
    request, ids, answer = next(corpus.records(corpus.shards[0]))
    if not held_out(request):
        assert table.lookup(ids[answer : answer + 3].tolist()) is not None  # a context of its own answer


def test_a_bundle_with_the_table_drafts_from_it_and_stays_exact(tmp_path, grown, chatty_dir):
    """export --ngram-table: the table travels in the bundle (hashed), auto verifies its guesses, and the output
    is plain decoding's; a table of another vocabulary is refused before the export."""
    from specdec_edge.api.pipeline import Pipeline
    from specdec_edge.bundle.manifest import read_manifest
    from specdec_edge.export.corpus import ngram_table, save_table
    from specdec_edge.export.exporter import export_bundle
    from specdec_edge.speculative.table import NgramTable

    corpus = Corpus.read(grown)
    path = save_table(ngram_table(corpus, min_count=1, every=10**9), tmp_path / "t.npz")
    bundle = export_bundle(str(chatty_dir), tmp_path / "b", capacity=256, ngram_table=path, progress=False)
    manifest = read_manifest(bundle)
    assert manifest.ngram_table == "ngram/table.npz" and manifest.ngram_table in manifest.files
    request = corpus.requests[0]
    with Pipeline.load(bundle, method="plain", threads=1) as plain:
        expected = plain.generate([{"role": "user", "content": request}], 80, reuse=False, history=False)
        with plain.with_method("auto") as auto:
            got = auto.generate([{"role": "user", "content": request}], 80, reuse=False, history=False)
    assert got.token_ids == expected.token_ids
    assert got.stats.by_proposer["table"].steps > 0  # its guesses were verified
    small = NgramTable.build([[1, 2, 3]], vocab=7)
    small.save(tmp_path / "small.npz")
    with pytest.raises(ExportError, match="vocabulary of 7 tokens"):
        export_bundle(
            str(chatty_dir), tmp_path / "b2", capacity=256, ngram_table=tmp_path / "small.npz", progress=False
        )
    with pytest.raises(ExportError, match="is not a file"):
        export_bundle(str(chatty_dir), tmp_path / "b3", capacity=256, ngram_table=tmp_path / "none.npz", progress=False)


@pytest.mark.parametrize("layers", [False, True])
def test_a_cached_shard_is_read_once_into_views_of_one_array_per_field(tmp_path, layers):
    """The sequences of a feature file are slices of one array per field (a shard's memory once, not once per
    sequence: reading each sequence's slice through the .npz kept a whole decompressed copy alive per sequence)."""
    from specdec_edge.export.draft_data import _read_part, _write_part

    rng = np.random.default_rng(0)
    seqs = [
        (
            rng.integers(0, 500, n).astype(np.int32),
            rng.standard_normal((n, 8)).astype(np.float16),
            n // 2,
            rng.standard_normal((n, 24)).astype(np.float16) if layers else None,
        )
        for n in (5, 9, 3, 7)
    ]
    _write_part(tmp_path / "part.npz", seqs, 8)
    read = _read_part(tmp_path / "part.npz", layers)
    assert len(read) == 4
    for got, (ids, feats, start, layer) in zip(read, seqs):
        np.testing.assert_array_equal(got["ids"], ids)
        np.testing.assert_array_equal(got["features"], feats)
        assert got["answer_start"] == start and got["ids"].dtype == np.int64
        if layers:
            np.testing.assert_array_equal(got["layer_features"], layer)
    fields = ["ids", "features"] + (["layer_features"] if layers else [])
    for field in fields:
        bases = {id(seq[field].base) for seq in read}
        assert len(bases) == 1 and read[0][field].base is not None, field


def test_a_feature_file_without_layer_features_is_refused_where_they_are_needed(tmp_path):
    from specdec_edge.export.draft_data import _read_part, _write_part

    _write_part(tmp_path / "part.npz", [(np.arange(4, dtype=np.int32), np.zeros((4, 8), np.float16), 2, None)], 8)
    with pytest.raises(ExportError, match="holds no layer features"):
        _read_part(tmp_path / "part.npz", layers=True)


def test_training_continues_an_earlier_head_on_the_first_shards_it_names(tmp_path, grown, chatty_bundle):
    """--corpus-shards trains on the first N shards (and a resumed run's error names the N it began with);
    --init starts from an earlier run's weights and draft vocabulary: with lr 0 the head comes out as it went in."""
    from safetensors.numpy import load_file

    from specdec_edge.export.train_draft import train_draft
    from tests.tiny_models import TRAIN

    corpus = tmp_path / "c"
    shutil.copytree(grown, corpus)
    grow_one_more(chatty_bundle, corpus)
    assert len(Corpus.read(corpus).shards) == 2
    settings = dict(TRAIN, epochs=1, corpus=corpus, threads=1, progress=False, held_out_every=1000)
    first = train_draft("eagle", str(chatty_bundle), tmp_path / "a", **settings, corpus_shards=1)
    training = json.loads((first / "config.json").read_text())["training"]
    assert training["corpus_shards"] == 1
    assert training["sequences"] == len(Corpus.read(corpus).shards[0]["records"])
    with pytest.raises(ExportError, match="holds 2 shards, not 3"):
        train_draft("eagle", str(chatty_bundle), tmp_path / "x", **settings, corpus_shards=3)
    with pytest.raises(ExportError, match="--corpus-shards 1"):  # the corpus grew: the rerun is told what to pass
        train_draft("eagle", str(chatty_bundle), tmp_path / "a", **settings)
    # --corpus-from: the heads continue on the shard they have not seen, and only on it
    newer = train_draft("eagle", str(chatty_bundle), tmp_path / "n", **settings, init=first, corpus_from=1)
    training = json.loads((newer / "config.json").read_text())["training"]
    assert training["corpus_from"] == 1 and training["corpus_shards"] == 2
    assert training["sequences"] == len(Corpus.read(corpus).shards[1]["records"])
    with pytest.raises(ExportError, match="--corpus-from 2 leaves no shard of the 2"):
        train_draft("eagle", str(chatty_bundle), tmp_path / "y", **settings, corpus_from=2)

    second = train_draft("eagle", str(chatty_bundle), tmp_path / "b", **dict(settings, lr=0.0), init=first)
    before, after = load_file(str(first / "weights.safetensors")), load_file(str(second / "weights.safetensors"))
    assert set(before) == set(after)
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)
    training = json.loads((second / "config.json").read_text())["training"]
    assert training["corpus_shards"] == 2 and training["init"]["folder"] == "eagle"
    assert training["init"]["training"]["corpus_shards"] == 1
    # the same --init trained with a learning rate moves away from it
    third = train_draft("eagle", str(chatty_bundle), tmp_path / "c3", **settings, init=first)
    moved = load_file(str(third / "weights.safetensors"))
    assert any(not np.array_equal(before[k], moved[k]) for k in before if k != "vocab_ids")
    np.testing.assert_array_equal(before["vocab_ids"], moved["vocab_ids"])
    with pytest.raises(ExportError, match="holds eagle heads, not medusa"):
        train_draft("medusa", str(chatty_bundle), tmp_path / "m", **settings, init=first)


def test_held_out_prompts_are_a_shards_requests_as_bench_reads_them(tmp_path, grown):
    from benchmarks.heldout_prompts import heldout_prompts, write_jsonl
    from specdec_edge.bench.spec_bench import load_prompts

    corpus = Corpus.read(grown)
    requests = [request for request, _, _ in corpus.records(corpus.shards[0])]
    out = write_jsonl(heldout_prompts(grown, 0, 2), tmp_path / "heldout.jsonl")
    prompts = load_prompts(out, n_per_category=5)
    assert [list(p.turns) for p in prompts] == [[r] for r in requests[:2]]
    assert {p.category for p in prompts} == {"heldout"}
    with pytest.raises(Exception, match="has no shard 7"):
        heldout_prompts(grown, 7, 2)


def test_edit_prompts_wrap_a_shards_answers_in_edit_instructions(tmp_path, grown, chatty_bundle):
    from tokenizers import Tokenizer

    from benchmarks.heldout_prompts import EDITS, edit_prompts, looping

    corpus = Corpus.read(grown)
    tok = Tokenizer.from_file(str(chatty_bundle / "tokenizer.json"))
    answers = [tok.decode([int(t) for t in ids[a:]]).strip() for _, ids, a in corpus.records(corpus.shards[0])]
    records = edit_prompts(grown, 0, 5, chatty_bundle / "tokenizer.json")
    kept = [a for a in answers if a and not looping(a)]
    assert records and len(records) == min(5, len(kept)) and {r["category"] for r in records} == {"edit"}
    for i, r in enumerate(records):
        instruction, _, text = r["turns"][0].partition("\n\n")
        assert instruction == EDITS[i % len(EDITS)] and text and any(a.startswith(text) for a in kept)
    assert looping("one two three four " * 5) and not looping("a b c d e f g h i j")
    with pytest.raises(Exception, match="has no shard 7"):
        edit_prompts(grown, 7, 2, chatty_bundle / "tokenizer.json")


def test_corpus_features_are_the_target_graphs_even_where_a_prefill_graph_would_prefill(
    tmp_path, chatty_dir, monkeypatch
):
    """On a machine where `--prefill auto` chose the bundle's prefill graph (fp32 activations), the features a head
    trains on still come from the target graph, which computes them at run time in decode and verify passes."""
    from specdec_edge.api.pipeline import Pipeline
    from specdec_edge.bundle.manifest import read_manifest
    from specdec_edge.export.corpus_data import corpus_data
    from specdec_edge.export.exporter import export_bundle
    from specdec_edge.runtime.base import prefill
    from specdec_edge.runtime.graph_prefill import GraphPrefill
    from specdec_edge.speculative.features import FeatureTap

    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(GraphPrefill, "min_rows", 8)  # the tiny model's sequences are short
    bundle = export_bundle(
        str(chatty_dir), tmp_path / "b", dtype="int4", capacity=256, hidden_states=True, progress=False
    )
    assert read_manifest(bundle).target.graph.prefill_path
    Pipeline.load(bundle, method="plain", threads=1).close()  # measures this machine's prefill choice
    for path in (tmp_path / "cache" / "prefill").glob("*.json"):  # as if the prefill graph had won it here
        path.write_text(json.dumps({**json.loads(path.read_text()), "runtime": "fp32"}))
    corpus = tmp_path / "c"
    grow(bundle, corpus, SETTINGS, answer_tokens_goal=1, load=ONE_THREAD, log=lambda m: None)
    train, apart = corpus_data(bundle, corpus, tmp_path / "f", held_out_every=10**6, threads=1, progress=False)
    seq = max(train + apart, key=lambda s: len(s["ids"]))
    assert len(seq["ids"]) >= 2 * GraphPrefill.min_rows
    for runtime, same in (("onnxruntime", True), ("fp32", False)):
        with Pipeline.load(bundle, method="plain", threads=1, prefill=runtime) as pipe:
            tap = FeatureTap(pipe.engines.target)
            prefill(tap, seq["ids"].tolist())
            features = tap.features[: len(seq["ids"])].astype(np.float16)
        assert np.array_equal(features, seq["features"]) == same, runtime


def test_a_corpus_grown_with_sleeping_thread_pools_holds_the_same_shard(tmp_path, chatty_bundle, monkeypatch):
    """`corpus --no-spinning` (for a background job: its thread pools sleep instead of spinning) loads the runtime
    so and writes what the default writes: the pool changes how threads wait, not what the model computes."""
    from click.testing import CliRunner

    from specdec_edge.api.pipeline import Pipeline
    from specdec_edge.cli import main

    loaded, real_load = [], Pipeline.load.__func__

    def load(cls, bundle, settings=None, **keywords):  # the real load, recording how the pools were asked for
        loaded.append(keywords.get("spinning", True) if settings is None else settings.spinning)
        return real_load(cls, bundle, settings, **keywords)

    monkeypatch.setattr(Pipeline, "load", classmethod(load))
    shards = []
    for flag in ("--spinning", "--no-spinning"):
        folder = tmp_path / flag
        args = ["corpus", str(folder), "--bundle", str(chatty_bundle), "--goal", "1", "--per-shard", "2", "--threads",
                "1", flag]  # fmt: skip
        result = CliRunner().invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        shards.append((folder / "shard-00000.ids").read_bytes())
    assert loaded == [True, False]
    assert shards[0] == shards[1] and len(shards[0]) > 0
