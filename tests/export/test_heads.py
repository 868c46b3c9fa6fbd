"""Trained self-drafting on tiny models: training, head export, EAGLE/Medusa tree proposals.

Invariants: a short training run lowers the loss and resumes from its checkpoint to the same
weights; every head recipe trains, exports and validates; head graphs match their torch
modules; one tree pass gives the logits of sequential passes along each branch; the feature
tap after compaction equals a plain chain's features; eagle and medusa greedy output equals
plain greedy token for token; sampling is seeded.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from specdec_edge import Pipeline
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.errors import SpecdecError
from specdec_edge.export.head_recipes import RECIPES
from specdec_edge.runtime.tree import path_to, tree_inputs
from specdec_edge.sampling import SamplingParams, make_rng, probs_from_logits
from specdec_edge.speculative.features import FeatureTap
from specdec_edge.speculative.loop import decode, prefill
from specdec_edge.speculative.medusa import MEDUSA_TREE, MedusaProposer
from specdec_edge.speculative.stats import Stats
from tests.speculative.test_acceptance import CHI2_CRIT_DF7_P001
from tests.speculative.test_methods import assert_greedy_equals_plain
from tests.tiny_models import TRAIN
from tests.unit.test_light_runtime import heavy_modules, run_clean


@pytest.fixture(scope="module")
def plain(heads_bundle):
    return Pipeline.load(heads_bundle, method="plain", threads=1)


def _config(folder):
    import json

    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_training_lowers_the_loss(trained, method):
    t = _config(trained / method)["training"]
    assert t["steps"] == t["planned_steps"] >= 50
    assert t["final_loss"] < 0.85 * t["first_loss"], t
    assert t["draft_vocab"] == 200 and t["sequences"] == 8


def test_training_resumes_from_its_checkpoint(tmp_path, monkeypatch, trained, prompts_file):
    from dataclasses import replace

    import torch

    from specdec_edge.export import train_draft as td

    bundle = trained / "target-bundle"
    calls = {"n": 0}
    real = RECIPES["eagle"]

    def interrupted(*args):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real.loss(*args)

    monkeypatch.setitem(RECIPES, "eagle", replace(real, loss=interrupted))
    # the same answers as the uninterrupted run's (which the PyTorch model made; a bundle target reads them)
    shutil.copytree(trained / "data", tmp_path / "data")
    with pytest.raises(KeyboardInterrupt):
        td.train_draft("eagle", str(bundle), tmp_path, prompts=prompts_file, **TRAIN)
    assert torch.load(tmp_path / "eagle" / "checkpoint.pt", weights_only=False)["step"] == 4
    monkeypatch.setitem(RECIPES, "eagle", real)
    td.train_draft("eagle", str(bundle), tmp_path, prompts=prompts_file, **TRAIN)
    a = torch.load(tmp_path / "eagle" / "checkpoint.pt", weights_only=False)["head"]
    b = torch.load(trained / "eagle" / "checkpoint.pt", weights_only=False)["head"]
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in b)


@pytest.mark.parametrize("method", sorted(RECIPES))
def test_every_head_recipe_trains_exports_and_validates(tmp_path, tiny_llama_dir, method):
    """Each registered recipe, on the tiny target: its loss trains every weight; its graph exports and validates."""
    import json

    import onnx
    import torch
    from safetensors.numpy import load_file

    from specdec_edge.export.head_builder import QUANTIZED_TOLERANCE
    from specdec_edge.export.head_export import TOLERANCE, export_head_graph
    from specdec_edge.export.head_modules import FrozenTarget
    from specdec_edge.export.heads_folder import load_heads, save_heads

    recipe = RECIPES[method]
    c = json.loads((tiny_llama_dir / "config.json").read_text())
    weights = load_file(str(tiny_llama_dir / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    lm_head = weights.get("lm_head.weight", embed)
    vocab_ids = np.arange(0, c["vocab_size"], 2)  # a reduced draft vocabulary
    H = c["hidden_size"]
    cfg = recipe.config(
        H, c["vocab_size"], len(vocab_ids), c["num_key_value_heads"], H // c["num_attention_heads"], 3, (0, 1, 1)
    )
    assert recipe.name == cfg.method == method and recipe.epochs >= 1
    assert json.loads(json.dumps(recipe.tree)) == recipe.tree  # goes into the manifest as is
    torch.manual_seed(0)
    head = recipe.module(cfg, FrozenTarget(embed, lm_head, vocab_ids))
    rng = np.random.default_rng(0)
    seqs = [
        {
            "ids": rng.integers(0, c["vocab_size"], n),
            "features": rng.standard_normal((n, H)).astype(np.float16),
            "layer_features": rng.standard_normal((n, 3 * H)).astype(np.float16),  # EAGLE-3 reads them
            "answer_start": 2,
        }
        for n in (9, 5)
    ]
    loss, agree = recipe.loss(head, seqs, 8)
    loss.backward()
    assert torch.isfinite(loss) and 0.0 <= agree <= 1.0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())
    with torch.no_grad():  # away from Medusa's zero init, so that the graph has something to get wrong
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    loaded = load_heads(save_heads(tmp_path / method, head, vocab_ids), embed, lm_head)
    report = export_head_graph(loaded, tmp_path / f"{method}.onnx")
    assert report["tolerance"] == (QUANTIZED_TOLERANCE if recipe.build else TOLERANCE)  # 8-bit layers: looser
    assert report["max_rel_err"] < report["tolerance"] and report["topk_ids_agreement"] == 1.0
    graph = onnx.load(str(tmp_path / f"{method}.onnx")).graph
    assert tuple(i.name for i in graph.input) == recipe.inputs
    assert tuple(o.name for o in graph.output) == recipe.outputs


def depths(parents) -> list[int]:
    """Each tree node's depth (1 = a child of the last context token), from its parent array."""
    out = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def test_manifest_records_heads(heads_bundle, plain):
    heads = read_manifest(heads_bundle).heads
    assert set(heads) == {"eagle", "medusa"}
    assert read_manifest(heads_bundle).target.graph.has_hidden_states
    for method in ("eagle", "medusa"):
        s = heads[method]
        assert s.validation["max_rel_err"] < s.validation["tolerance"]
        assert s.validation["topk_ids_agreement"] == 1.0
        assert s.training["prompts"] == 8 and s.config["draft_vocab"] == 200
        assert (heads_bundle / s.graph).is_file()
    # The recorded tree settings are the trees the heads draft: EAGLE's ``nodes`` tokens, at most ``topk``
    # children each, within ``depth`` levels; one Medusa token per recorded path, at its path's depth.
    drafted = {}
    for method in ("eagle", "medusa"):
        pipe = plain.with_method(method)
        prompt = pipe.encode("the quick brown fox jumps over")
        prefill(pipe.decoder.engine, prompt[:-1])
        pipe.decoder.proposer.prefill(prompt, None, None)
        drafted[method] = pipe.decoder.proposer.propose(prompt, 4)
    tree, eagle = heads["eagle"].tree, drafted["eagle"]
    assert len(eagle.tokens) == tree["nodes"] and max(depths(eagle.parents)) <= tree["depth"]
    assert max(np.unique(eagle.parents, return_counts=True)[1]) <= tree["topk"]
    paths = heads["medusa"].tree["tree"]
    assert sorted(depths(drafted["medusa"].parents)) == sorted(len(p) for p in paths)


def test_pipeline_uses_the_recorded_tree_settings_unless_told_otherwise(plain):
    eagle = plain.with_method("eagle").decoder.proposer
    assert (eagle.topk, eagle.nodes, eagle.depth) == tuple(RECIPES["eagle"].tree[k] for k in ("topk", "nodes", "depth"))
    assert plain.with_method("eagle", nodes=9).decoder.proposer.nodes == 9
    medusa = plain.with_method("medusa").decoder.proposer
    assert medusa.paths == [tuple(p) for p in RECIPES["medusa"].tree["tree"]]


def test_info_shows_heads_and_default_method(heads_bundle):
    from click.testing import CliRunner

    from specdec_edge.cli import main

    res = CliRunner().invoke(main, ["info", str(heads_bundle)])
    assert res.exit_code == 0, res.output
    assert "eagle heads: draft vocab 200, tree: topk 3, nodes 5, depth 3" in res.output
    assert "medusa heads:" in res.output and "default method: auto" in res.output


def test_add_heads_writes_a_new_bundle(tmp_path, trained):
    from specdec_edge.export.head_export import add_heads

    out = add_heads(trained / "target-bundle", [trained / "medusa"], tmp_path / "with-medusa")
    manifest = read_manifest(out)
    assert set(manifest.heads) == {"medusa"}
    ref = Pipeline.load(trained / "target-bundle", method="plain", threads=1).generate("the quick brown", 20)
    got = Pipeline.load(out, threads=1).generate("the quick brown", 20)
    assert got.token_ids == ref.token_ids


@pytest.mark.parametrize(
    "method,k,options",
    [
        ("eagle", 4, {}),
        ("eagle", 6, {"topk": 3, "nodes": 10}),
        ("eagle", 2, {"topk": 1, "nodes": 1}),
        ("medusa", 4, {}),
        ("medusa", 3, {"tree": [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]}),
        ("pld-eagle", 4, {}),
        ("pld-eagle", 3, {"min_ngram": 1, "topk": 2, "nodes": 4}),
    ],
)
def test_heads_greedy_equals_plain(plain, method, k, options):
    assert_greedy_equals_plain(plain, plain.with_method(method, k=k, **options))


@pytest.mark.parametrize("nodes", [2, 4])
def test_eagle_chain_grows_what_the_tree_code_grows_at_topk_1(plain, nodes):
    chain = plain.with_method("eagle", k=4, topk=1, nodes=nodes, depth=4)
    proposer = chain.decoder.proposer
    grow, pairs = proposer._chain, []

    def both(n, k, feature, logp, top):
        want = proposer._tree(n, k, feature[-1], logp, top)  # the general code, on the same head state
        pairs.append((grow(n, k, feature, logp, top), want))
        return pairs[-1][0]

    proposer._chain = both
    assert chain.generate("the quick brown fox jumps over the lazy dog", max_new_tokens=24).token_ids
    assert len(pairs) > 3 and max(len(got.tokens) for got, _ in pairs) == nodes
    for got, want in pairs:
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.parents, want.parents)
        np.testing.assert_array_equal(got.confidence, want.confidence)


def test_medusa_typical_is_exact_when_greedy_and_labelled_lossy_by_bench(plain):
    from specdec_edge.bench.spec_bench import BenchPrompt, run_bench, to_markdown

    typical = plain.with_method("medusa-typical", k=4, epsilon=0.2, delta=0.5)
    assert (typical.decoder.rule.epsilon, typical.decoder.rule.delta, typical.decoder.rule.lossy) == (0.2, 0.5, True)
    assert_greedy_equals_plain(plain, typical)  # typical acceptance applies when sampling only (as in Medusa)
    prompts = [BenchPrompt(1, "chat", ["the quick brown fox"])]
    report = run_bench(
        plain,
        ["plain", "medusa", "medusa-typical"],
        prompts,
        max_new_tokens=12,
        progress=False,
        temperature=0.8,
        seed=1,
    )
    assert report["meta"]["lossy_methods"] == ["medusa-typical"] and report["meta"]["temperature"] == 0.8
    assert report["results"]["medusa-typical"]["overall"]["identical_output_rate"] is None  # sampled: not compared
    table = to_markdown(report)
    assert "| medusa-typical (lossy) |" in table and "| medusa |" in table and "sampling at temperature 0.8" in table


def test_eagle_options_are_checked(plain):
    for bad in ({"nodes": "abc"}, {"topk": 0}, {"depth": 1.5}, {"topk": 99}, {"width": 2}):
        with pytest.raises(SpecdecError, match="bad option for method 'eagle'|EAGLE needs"):
            plain.with_method("eagle", **bad)


def test_medusa_typical_options_are_checked(plain):
    for bad in ({"epsilon": "abc"}, {"delta": 0}, {"epsilon": -1}):
        with pytest.raises(SpecdecError, match=r"bad option for method 'medusa-typical'.*number (> 0|in \(0, 1\])"):
            plain.with_method("medusa-typical", **bad)


def test_medusa_typical_accepts_more_than_exact_rejection_when_sampling(plain):
    """On the same seeds, typical acceptance takes more draft tokens than exact recursive rejection."""
    exact, typical = plain.with_method("medusa", k=4), plain.with_method("medusa-typical", k=4)
    accepted = {"exact": 0, "typical": 0}
    for seed in range(6):
        for name, pipe in (("exact", exact), ("typical", typical)):
            accepted[name] += pipe.generate(
                "the quick brown fox", max_new_tokens=24, temperature=0.7, seed=seed
            ).stats.accepted
    assert accepted["typical"] > accepted["exact"], accepted


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_heads_sampling_is_seeded(plain, method):
    pipe = plain.with_method(method, k=4)
    a, b, c = (pipe.generate("the quick brown fox", max_new_tokens=30, temperature=0.8, seed=s) for s in (3, 3, 4))
    assert a.token_ids == b.token_ids != c.token_ids


@pytest.mark.parametrize("method", ["eagle", "medusa", "pld-eagle"])
def test_heads_sampling_keeps_the_target_distribution(plain, method):
    """First emitted token over many seeds vs the target's exact top-8 distribution (chi-square, df 7)."""
    # Wide trees (the shipped defaults are small, tuned for speed): enough acceptances to test the rule.
    wide = {
        "eagle": {"topk": 6, "nodes": 16},
        "medusa": {"tree": [q for q in MEDUSA_TREE if len(q) <= 3]},
        "pld-eagle": {"topk": 6, "nodes": 16},
    }
    assert_first_token_keeps_the_distribution(plain, plain.with_method(method, k=4, **wide[method]))


def test_an_eagle_chain_samples_its_drafts_from_the_head_and_keeps_the_target_distribution(plain):
    """A chain (topk 1) under sampling draws each draft token from the head's distribution over its best tokens and
    hands that distribution to the exact rule (min(1, p/q)); greedy calls still take the head's best token."""
    pipe = plain.with_method("eagle", k=4, topk=1, nodes=4)
    eagle = pipe.decoder.proposer
    ids = plain.encode("the quick brown fox jumps")
    params = SamplingParams(temperature=1.0, top_k=8)
    prefill(pipe.decoder.engine, ids[:-1])
    eagle.prefill(ids, params, make_rng(0))
    drafted = eagle.propose(ids, 4)
    q = drafted.probs
    assert q is not None and q.shape == (len(drafted.tokens), plain.engines.target.vocab_size)
    assert np.allclose(q.sum(axis=1), 1.0) and (q[np.arange(len(q)), drafted.tokens] > 0).all()
    assert (np.count_nonzero(q, axis=1) > 1).all()  # a distribution over the head's best tokens, not its argmax
    eagle.prefill(ids, SamplingParams(), make_rng(0))
    assert eagle.propose(ids, 4).probs is None
    assert_first_token_keeps_the_distribution(plain, pipe)


def assert_first_token_keeps_the_distribution(plain, pipe):
    """The first token ``pipe`` samples over 1,500 seeds vs the target's exact top-8 distribution (chi-square,
    df 7), with enough accepted draft tokens for the test to exercise the rule."""
    params = SamplingParams(temperature=1.0, top_k=8)
    ids = plain.encode([{"role": "user", "content": "the quick brown fox jumps"}])
    prefill(plain.engines.target, ids[:-1])
    p = probs_from_logits(plain.engines.target.run(ids[-1:]).logits, params)[0]
    support = np.flatnonzero(p)
    firsts, accepted = [], 0
    for seed in range(1500):
        stats = Stats()
        chunk = next(
            decode(
                pipe.decoder.engine,
                pipe.decoder.proposer,
                ids,
                max_new_tokens=2,
                params=params,
                k=4,
                rng=make_rng(seed),
                stats=stats,
            )
        )
        firsts.append(chunk.tokens[0])
        accepted += stats.accepted
    counts = np.array([firsts.count(t) for t in support])
    assert counts.sum() == len(firsts) and len(support) == 8
    expected = p[support] * len(firsts)
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_CRIT_DF7_P001
    assert accepted > 100, f"the tree was accepted {accepted} times: the test would prove little"


def test_default_method_of_a_heads_bundle(heads_bundle, tmp_path, trained):
    from specdec_edge.export.head_export import add_heads

    assert Pipeline.load(heads_bundle, threads=1).method == "auto"  # the heads are among auto's choices
    out = add_heads(trained / "target-bundle", [trained / "medusa"], tmp_path / "b")
    assert Pipeline.load(out, threads=1).method == "auto"  # a bundle's default is --default-method's, else auto


def test_tree_pass_equals_sequential_branches_and_tap_follows_compaction(plain):
    """An EAGLE tree in one target pass vs each branch run as a chain; then commit a branch."""
    pipe = plain.with_method("eagle", k=4, topk=3, nodes=12)
    prompt = pipe.encode("the quick brown fox jumps over")
    tap = pipe.decoder.engine
    prefill(tap, prompt[:-1])
    pipe.decoder.proposer.prefill(prompt, None, None)
    proposal = pipe.decoder.proposer.propose(prompt, 4)
    parents = np.concatenate([[-1], proposal.parents + 1])
    ids = np.concatenate([[prompt[-1]], proposal.tokens])
    assert len(proposal.tokens) == 12 and proposal.parents.max() >= 0
    positions, bias = tree_inputs(parents, tap.length)
    out = tap.run(ids, positions, bias)
    tree_logits, tree_hidden = np.array(out.logits), np.array(out.hidden_states)
    base = tap.length
    for node in range(len(ids)):
        branch = path_to(parents, node)
        chain = tap.engine.run(ids[branch])
        assert np.allclose(chain.logits[-1], tree_logits[node], atol=1e-4)
        assert np.allclose(chain.hidden_states[-1], tree_hidden[node], atol=1e-4)
    # Compact the deepest branch; the tap's features must equal a plain prefill's.
    deepest = int(np.argmax([len(path_to(parents, i)) for i in range(len(ids))]))
    branch = np.array(path_to(parents, deepest))
    tap.run(ids, positions, bias)
    tap.commit(len(branch), branch)
    features = tap.features[: tap.length].copy()
    reference = FeatureTap(tap.engine)
    prefill(reference, list(prompt[:-1]) + ids[branch].tolist())
    assert tap.length == base + len(branch) == reference.length
    assert np.allclose(features, reference.features[: reference.length], atol=1e-4)
    nxt = tap.engine.run([7])  # the compacted cache continues like the chain
    again = reference.engine.run([7])
    assert np.allclose(nxt.logits, again.logits, atol=1e-5)


def test_errors_say_what_to_do(tiny_bundle, plain):
    pipe = Pipeline.load(tiny_bundle, method="plain", threads=1)
    with pytest.raises(SpecdecError, match="train-draft"):
        pipe.with_method("eagle")
    with pytest.raises(SpecdecError, match="prefix"):
        plain.with_method("medusa", tree=[(0, 1)])
    with pytest.raises(SpecdecError, match="topk"):
        plain.with_method("eagle", topk=99)
    assert isinstance(plain.with_method("medusa").decoder.proposer, MedusaProposer)


def test_heads_pipeline_without_heavy_imports(heads_bundle):
    res = run_clean(f"""
        from specdec_edge import Pipeline
        pipe = Pipeline.load({str(heads_bundle)!r}, method="eagle")
        print("TOKENS", len(pipe.generate("The quick brown fox", max_new_tokens=8).token_ids))
    """)
    assert res.returncode == 0, res.stderr
    assert "TOKENS" in res.stdout and heavy_modules(res) == "[]"


def test_train_draft_cli(tmp_path, trained, prompts_file):
    """The command trains from a bundle with hidden states, then resumes as a no-op."""
    from click.testing import CliRunner

    from specdec_edge.cli import main

    args = [
        "train-draft",
        "--method",
        "medusa",
        "--target",
        str(trained / "target-bundle"),
        "--out",
        str(tmp_path),
        "--prompts",
        str(prompts_file),
        "--max-prompts",
        "4",
        "--answer-tokens",
        "8",
        "--epochs",
        "1",
        "--draft-vocab",
        "0",
        "--threads",
        "1",
    ]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "Wrote medusa heads" in res.output and (tmp_path / "medusa" / "weights.safetensors").is_file()
    assert _config(tmp_path / "medusa")["draft_vocab"] == _config(tmp_path / "medusa")["vocab_size"]
    res = CliRunner().invoke(main, args[:-2] + ["--threads", "2", "--epochs", "2"])
    assert res.exit_code == 2 and "other settings" in res.output


SHIPPED = Path(__file__).resolve().parents[2] / "specdec_edge" / "data" / "heads"


@pytest.mark.skipif(not SHIPPED.is_dir(), reason="no shipped heads")
@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_shipped_heads_are_small_fp16_and_load(method):
    from safetensors import safe_open

    from specdec_edge.export.heads_folder import load_heads

    folder = SHIPPED / method
    cfg = _config(folder)
    assert cfg["method"] == method and cfg["training"]["steps"] > 0
    assert (folder / "weights.safetensors").stat().st_size < 16e6
    with safe_open(str(folder / "weights.safetensors"), "np") as f:
        dtypes = {f.get_tensor(k).dtype.name for k in f.keys() if k != "vocab_ids"}
    assert dtypes == {"float16"}
    shape = (cfg["vocab_size"], cfg["hidden_size"])
    head = load_heads(folder, np.zeros(shape, np.float32), np.zeros(shape, np.float32))
    assert head.target.lm_head_t.shape == (cfg["hidden_size"], cfg["draft_vocab"])


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_add_heads_to_a_quantized_bundle_works_like_exporting_with_them(tmp_path, tiny_llama_dir, trained, dtype):
    """Heads added to an existing quantized bundle read the weights its graph computes, and are recorded as the
    exactness policy allows on it (as `export --heads` records them); eagle and pld-eagle then run greedy-identical
    to plain without allow_inexact."""
    from specdec_edge.exactness import trees_exact
    from specdec_edge.export.exporter import export_bundle
    from specdec_edge.export.head_export import add_heads, target_weights
    from tests.speculative.test_methods import assert_greedy_equals_plain

    base = export_bundle(str(tiny_llama_dir), tmp_path / dtype, dtype=dtype, capacity=256, hidden_states=True,
                         progress=False)  # fmt: skip
    embed, head = target_weights(base)
    float_embed, _ = target_weights(trained / "target-bundle")
    assert embed.shape == float_embed.shape and np.abs(embed - float_embed).max() < 0.05 * np.abs(float_embed).max()
    out = add_heads(base, [trained / "eagle"], tmp_path / "with-eagle")
    graph = read_manifest(out).target.graph
    tree = read_manifest(out).heads["eagle"].tree
    assert (tree.get("topk", 1) > 1) == trees_exact(graph.verdict, dtype)
    plain = Pipeline.load(out, method="plain", threads=1)
    for method in ("eagle", "pld-eagle"):
        assert_greedy_equals_plain(plain, plain.with_method(method))


def damage(path: Path) -> None:
    """Flip one byte in the middle of ``path``, keeping its size (the fast load check reads sizes only)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("rel", ["target/model.onnx.data", "target/model.onnx", "tokenizer.json"])
def test_add_heads_refuses_a_damaged_bundle(tmp_path, trained, rel):
    """A source file that no longer matches its manifest (the weights, the graph, the tokenizer) stops add_heads with
    one error naming it, even where the hash record vouched for the file before; no bundle is written."""
    from specdec_edge.bundle.hashes import verify_bundle
    from specdec_edge.errors import BundleError
    from specdec_edge.export.head_export import add_heads

    source = tmp_path / "source"
    shutil.copytree(trained / "target-bundle", source)
    assert verify_bundle(source) == []  # the hash record now vouches for every file
    damage(source / rel)
    with pytest.raises(BundleError, match=f"damaged: {rel} do not match") as e:
        add_heads(source, [trained / "medusa"], tmp_path / "out")
    assert "specdec-edge verify" in str(e.value)
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["source"]


def test_build_engines_refuses_a_damaged_graph(tmp_path, portable_bundle):
    """TensorRT engines are built from graphs hashed first: an engine of damaged bytes is never recorded (the check
    comes before TensorRT is imported, so it runs here without it)."""
    from specdec_edge.errors import BundleError
    from specdec_edge.export.build_engines import build_engines

    source = tmp_path / "portable"
    shutil.copytree(portable_bundle, source)
    damage(source / "target/model.onnx.data")
    with pytest.raises(BundleError, match="damaged: target/model.onnx.data"):
        build_engines(source, backends=("trt",), echo=lambda *a: None)


def _edit_config(**changes):
    return lambda cfg, tensors: cfg.update(changes)


def _edit_tensor(name, edit):
    return lambda cfg, tensors: tensors.__setitem__(name, edit(tensors[name]))


def _nan(v):
    v = v.copy()
    v.flat[0] = np.nan
    return v


DAMAGED_HEADS = {  # id: (trained folder, edit(config dict, tensors dict), what the error says)
    "missing-tensor": ("eagle", lambda cfg, t: t.pop("fc.weight"), "missing fc.weight"),
    "changed-size": ("eagle", _edit_config(intermediate_size=256), "is [192, 64], its config makes [256, 64]"),
    "relabelled-as-medusa": ("eagle", _edit_config(method="medusa", medusa_heads=3), "missing bias, weight"),
    "relabelled-as-eagle": ("medusa", _edit_config(method="eagle"), "num_heads=0, but the method eagle needs"),
    "relabelled-as-eagle3": ("eagle", _edit_config(method="eagle3"), "feature_layers=[] does not fit"),
    "huge-size": ("eagle", _edit_config(intermediate_size=10**12), "intermediate_size=1000000000000 is not"),
    "huge-medusa": ("medusa", _edit_config(medusa_heads=10**9), "medusa_heads=1000000000 is not"),
    "string-size": ("eagle", _edit_config(hidden_size="64"), "hidden_size='64' is not"),
    "draft-vocab": ("eagle", _edit_config(draft_vocab=10**5), "draft_vocab=100000 is more than"),
    "vocab-id-range": ("eagle", _edit_tensor("vocab_ids", lambda v: v + 10**6), "vocab_ids are not distinct"),
    "vocab-id-count": ("medusa", _edit_tensor("vocab_ids", lambda v: v[:-1]), "vocab_ids is not 200 integers"),
    "nan-weight": ("eagle", _edit_tensor("fc.weight", _nan), "fc.weight is not finite"),
    "wrong-shape": ("medusa", _edit_tensor("weight", lambda v: v[:, :-1]), "weight is [4, 63, 64]"),
}


@pytest.mark.parametrize("case", list(DAMAGED_HEADS))
def test_damaged_heads_folders_are_refused_with_one_error(tmp_path, tiny_llama_dir, trained, case):
    """`export --heads` reads a heads folder strictly, before the slow export: each damage (a tensor missing, sizes
    changed, the method relabelled, huge or mistyped sizes, draft ids out of range, NaN weights) is one ExportError
    naming the folder and what to do, never random heads "validated" against themselves or a traceback."""
    import json

    from safetensors.numpy import load_file, save_file

    from specdec_edge.errors import ExportError
    from specdec_edge.export.exporter import export_bundle

    source, edit, says = DAMAGED_HEADS[case]
    folder = tmp_path / f"{source}-{case}"
    shutil.copytree(trained / source, folder)
    cfg, tensors = json.loads((folder / "config.json").read_text()), load_file(str(folder / "weights.safetensors"))
    edit(cfg, tensors)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "weights.safetensors"))
    with pytest.raises(ExportError) as e:
        export_bundle(str(tiny_llama_dir), tmp_path / "out", capacity=64, heads=(folder,), progress=False)
    assert str(folder) in str(e.value) and says in str(e.value) and "train-draft" in str(e.value), str(e.value)


def test_a_truncated_heads_weights_file_is_refused(tmp_path, tiny_llama_dir, trained):
    from specdec_edge.errors import ExportError
    from specdec_edge.export.exporter import export_bundle

    folder = tmp_path / "eagle"
    shutil.copytree(trained / "eagle", folder)
    data = (folder / "weights.safetensors").read_bytes()
    (folder / "weights.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError, match="unreadable weights file"):
        export_bundle(str(tiny_llama_dir), tmp_path / "out", capacity=64, heads=(folder,), progress=False)
