"""EAGLE-3 heads on tiny models: target layer features, training-time test, exactness, the serving checkpoint.

Invariants: the target graph's ``layer_features`` equal PyTorch's hidden states entering the chosen
layers (fp32 and fp16), and the manifest names those layers; a short training run lowers the loss;
eagle3 and pld-eagle3 greedy output equals plain greedy token for token, and sampling keeps the
target's distribution (chi-square); the feature tap keeps the layer features of accepted tree paths;
``export-drafter`` writes the reference EAGLE-3 layout (names, shapes, d2t/t2d, config keys) and
reading it back gives the same tensors and the same head.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from specdec_edge import Pipeline
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.errors import SpecdecError
from specdec_edge.speculative.features import FeatureTap
from specdec_edge.speculative.loop import prefill
from tests.export.test_heads import assert_first_token_keeps_the_distribution
from tests.speculative.test_methods import assert_greedy_equals_plain, many_prompts

# The tensors of an EAGLE-3 checkpoint as the reference EAGLE repository saves them and vLLM's and SGLang's
# LlamaForCausalLMEagle3 loaders read them (embed_tokens optional: shared with the target when absent),
# with their shapes for hidden size H, n target layers, draft vocabulary V', target vocabulary V.
REFERENCE_TENSORS = {
    "fc.weight": lambda c: (c["hidden_size"], 3 * c["hidden_size"]),
    "midlayer.self_attn.q_proj.weight": lambda c: (c["num_attention_heads"] * c["head_dim"], 2 * c["hidden_size"]),
    "midlayer.self_attn.k_proj.weight": lambda c: (c["num_key_value_heads"] * c["head_dim"], 2 * c["hidden_size"]),
    "midlayer.self_attn.v_proj.weight": lambda c: (c["num_key_value_heads"] * c["head_dim"], 2 * c["hidden_size"]),
    "midlayer.self_attn.o_proj.weight": lambda c: (c["hidden_size"], c["num_attention_heads"] * c["head_dim"]),
    "midlayer.mlp.gate_proj.weight": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "midlayer.mlp.up_proj.weight": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "midlayer.mlp.down_proj.weight": lambda c: (c["hidden_size"], c["intermediate_size"]),
    "midlayer.hidden_norm.weight": lambda c: (c["hidden_size"],),
    "midlayer.input_layernorm.weight": lambda c: (c["hidden_size"],),
    "midlayer.post_attention_layernorm.weight": lambda c: (c["hidden_size"],),
    "norm.weight": lambda c: (c["hidden_size"],),
    "lm_head.weight": lambda c: (c["draft_vocab_size"], c["hidden_size"]),
    "d2t": lambda c: (c["draft_vocab_size"],),
    "t2d": lambda c: (c["vocab_size"],),
}
# The keys of the reference repository's EAGLE-3 config (eagle/traineagle3/config.json), which a published
# checkpoint's config.json carries with architectures ["LlamaForCausalLMEagle3"].
REFERENCE_CONFIG_KEYS = {
    "architectures",
    "bos_token_id",
    "eos_token_id",
    "hidden_act",
    "hidden_size",
    "initializer_range",
    "intermediate_size",
    "max_position_embeddings",
    "model_type",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "pad_token_id",
    "rms_norm_eps",
    "tie_word_embeddings",
    "torch_dtype",
    "transformers_version",
    "use_cache",
    "vocab_size",
    "draft_vocab_size",
}


@pytest.fixture(scope="module")
def plain(eagle3_bundle):
    return Pipeline.load(eagle3_bundle, method="plain", threads=1)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_target_graph_outputs_the_chosen_layers(tmp_path, tiny_llama_dir, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    from specdec_edge.export.exporter import export_bundle
    from specdec_edge.runtime.ort_engine import OrtEngine
    from specdec_edge.runtime.threads import CpuThreads

    out = export_bundle(
        str(tiny_llama_dir), tmp_path / dtype, dtype=dtype, feature_layers=(0, 1), capacity=64, progress=False
    )
    manifest = read_manifest(out)
    graph = manifest.target.graph
    assert graph.feature_layers == (0, 1) and not graph.has_hidden_states
    assert {"name": "layer_features"}.items() <= next(o for o in graph.outputs if o["name"] == "layer_features").items()
    report = manifest.target.validation
    assert report["feature_layers"] == [0, 1] and report["layer_features_max_rel_err"] < report["tolerance"]
    engine = OrtEngine(str(out / graph.path), graph, cpu=CpuThreads(1))
    ids = np.array([5, 17, 42, 7, 99, 3])
    engine.run(ids[:4])
    engine.commit(4)
    got = engine.run(ids[4:]).layer_features  # a pass after a non-empty cache
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        hidden = model(torch.tensor(ids[None]), output_hidden_states=True).hidden_states
    want = np.concatenate([hidden[0][0, 4:].numpy(), hidden[1][0, 4:].numpy()], -1)
    assert got.shape == (2, 2 * graph.hidden_size)
    assert np.allclose(got, want, atol=1e-4 if dtype == "fp32" else 3e-2 * np.abs(want).max())


def test_training_lowers_the_loss(trained_eagle3, tiny_llama_dir):
    from specdec_edge.export.head_modules import default_feature_layers

    cfg = json.loads((trained_eagle3 / "config.json").read_text())
    t = cfg["training"]
    assert cfg["method"] == "eagle3" and cfg["ttt_steps"] >= 2
    assert cfg["feature_layers"] == list(default_feature_layers(2)) == [0, 1, 1]
    assert t["steps"] == t["planned_steps"] >= 50
    assert t["final_loss"] < 0.7 * t["first_loss"], t


def test_training_time_test_unrolls_the_run_time_chain():
    """The training loss's step-s log-probs at slot i are the head's when run as at run time: the committed
    slots 0..i with the target's layer features, then a chain that feeds each output back as the next
    step's feature (its own draft ancestors in its cache)."""
    import torch

    from specdec_edge.export.head_losses import answer_top1, eagle3_unroll
    from specdec_edge.export.head_modules import Eagle3Head, FrozenTarget
    from specdec_edge.export.head_recipes import RECIPES

    rng = np.random.default_rng(0)
    V, H, T, start = 96, 32, 14, 6
    vocab_ids = np.arange(0, V, 2)
    cfg = RECIPES["eagle3"].config(H, V, len(vocab_ids), 2, 8, 0, (0, 2, 3))
    torch.manual_seed(0)
    embed, lm_head = rng.standard_normal((V, H)), rng.standard_normal((V, H))
    head = Eagle3Head(cfg, FrozenTarget(embed, lm_head, vocab_ids)).eval()
    with torch.no_grad():
        for p in (head.input_norm, head.hidden_norm, head.post_norm, head.norm):
            p.add_(0.3 * torch.randn_like(p))
    x = rng.integers(0, V, T)
    seq = {
        "ids": x,
        "features": rng.standard_normal((T, H)).astype(np.float16),
        "layer_features": rng.standard_normal((T, 3 * H)).astype(np.float16),
        "answer_start": start,
    }
    with torch.no_grad():
        unrolled = [logp for logp, *_ in eagle3_unroll(head, [seq], 64)]
        g = torch.as_tensor(seq["layer_features"]).float()[None]
        none_g, none_f = torch.zeros(1, 0, 3 * H), torch.zeros(1, 0, H)
        for i in (1, start - 1, start + 2):
            bias = torch.zeros(1, 1, i + 1, i + 1).masked_fill(torch.ones(i + 1, i + 1).triu(1).bool(), float("-inf"))
            empty = torch.zeros(1, 0, cfg.num_kv_heads, cfg.head_dim)
            out, keys, values = head(g[:, : i + 1], none_f, torch.as_tensor(x[1 : i + 2])[None],
                                     torch.arange(i + 1)[None], empty, empty, bias)  # fmt: skip
            h = out[:, -1:]
            for s in range(cfg.ttt_steps):
                if s:
                    bias = torch.zeros(1, 1, 1, keys.shape[1] + 1)  # committed slots 0..i and its ancestors
                    ids = torch.as_tensor(x[i + 1 + s : i + 2 + s])[None]
                    h, k, v = head(none_g, h, ids, torch.tensor([[i + s]]), keys, values, bias)
                    keys, values = torch.cat([keys, k], 1), torch.cat([values, v], 1)
                want = head.logits(h[0, -1]).log_softmax(-1)
                if s and i < start - 1:
                    break  # step 0 scores every slot, the deeper steps the answer's
                row = i if s == 0 else i - (start - 1)
                assert torch.allclose(unrolled[s][row], want, atol=1e-4), (i, s)
        assert len(unrolled[0]) == T - 1 and all(len(u) == T - start for u in unrolled[1:])
        # the per-epoch answer top-1: step 0's agreement over the answer's slots that have a label (x[i+2])
        _, target_logp, labelled = next(eagle3_unroll(head, [seq], 64))
        agree = (unrolled[0].argmax(-1) == target_logp.argmax(-1)) & labelled
        assert answer_top1(head, [seq], 64) == (int(agree[start - 1 :].sum()), int(labelled[start - 1 :].sum()))


def test_folding_the_training_scale_keeps_the_function():
    """Training divides the layer features by a per-dimension scale; folding it into fc changes nothing."""
    import torch

    from specdec_edge.export.head_modules import Eagle3Head, FrozenTarget
    from specdec_edge.export.head_recipes import RECIPES

    rng = np.random.default_rng(1)
    V, H = 64, 32
    cfg = RECIPES["eagle3"].config(H, V, V, 2, 8, 0, (0, 1, 2))
    scale = rng.uniform(0.01, 300.0, 3 * H)
    torch.manual_seed(1)
    head = Eagle3Head(
        cfg, FrozenTarget(rng.standard_normal((V, H)), rng.standard_normal((V, H)), np.arange(V), feature_scale=scale)
    )
    g = torch.as_tensor(rng.standard_normal((1, 5, 3 * H)) * scale, dtype=torch.float32)
    empty = torch.zeros(1, 0, cfg.num_kv_heads, cfg.head_dim)
    args = (torch.zeros(1, 0, H), torch.as_tensor(rng.integers(0, V, (1, 5))), torch.arange(5)[None], empty, empty)
    bias = torch.zeros(1, 1, 5, 5)
    with torch.no_grad():
        before = head(g, *args, bias)[0]
        head.fold_feature_scale()
        after = head(g, *args, bias)[0]
    assert torch.equal(head.feature_scale, torch.ones(3 * H))
    assert torch.allclose(before, after, rtol=1e-4, atol=1e-4)


def test_manifest_records_the_head_and_its_layers(eagle3_bundle):
    manifest = read_manifest(eagle3_bundle)
    assert manifest.target.graph.feature_layers == (0, 1, 1)
    section = manifest.heads["eagle3"]
    assert section.config["feature_layers"] == [0, 1, 1]
    assert section.validation["max_rel_err"] < section.validation["tolerance"]
    assert section.validation["topk_ids_agreement"] == 1.0
    assert set(manifest.heads) == {"eagle3"}


@pytest.mark.parametrize(
    "method,k,options",
    [
        ("eagle3", 4, {}),
        ("eagle3", 6, {"topk": 3, "nodes": 10}),
        ("eagle3", 3, {"topk": 1, "nodes": 3}),
        ("pld-eagle3", 4, {}),
    ],
)
def test_greedy_equals_plain(plain, method, k, options):
    assert_greedy_equals_plain(plain, plain.with_method(method, k=k, **options))


@pytest.mark.parametrize("method", ["eagle3", "pld-eagle3"])
def test_sampling_keeps_the_target_distribution(plain, method):
    """First emitted token over many seeds vs the target's exact top-8 distribution (chi-square, df 7)."""
    pipe = plain.with_method(method, k=4, topk=6, nodes=16)  # wide: enough acceptances to test the rule
    assert_first_token_keeps_the_distribution(plain, pipe)


def test_tap_keeps_the_layer_features_of_accepted_paths(plain, eagle3_bundle):
    """After tree steps with compaction, the tap's layer features equal those of one prefill of the same text."""
    pipe = plain.with_method("eagle3", k=4, topk=3, nodes=8)
    text = "the quick brown fox jumps over"
    prompt, result = pipe.encode(text), pipe.generate(text, max_new_tokens=24)
    assert result.stats.accepted > 0
    tap = pipe.decoder.engine
    fresh = Pipeline.load(eagle3_bundle, method="eagle3", threads=1).decoder.engine
    prefill(fresh, (prompt + result.token_ids)[: tap.length])
    assert isinstance(fresh, FeatureTap) and fresh.length == tap.length
    assert np.allclose(tap.layer_features[: tap.length], fresh.layer_features[: fresh.length], atol=1e-4)


def test_manifest_checks_the_layers(tmp_path, eagle3_bundle):
    """A manifest whose head reads other layers than the target graph outputs is refused on loading."""
    import shutil

    from specdec_edge.errors import BundleError

    copy = tmp_path / "b"
    shutil.copytree(eagle3_bundle, copy)
    data = json.loads((copy / "manifest.json").read_text())
    data["heads"]["eagle3"]["config"]["feature_layers"] = [0, 1]
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BundleError, match="feature_layers"):
        read_manifest(copy)
    data["heads"]["eagle3"]["config"]["feature_layers"] = [0, 1, 1]
    data["target"]["graph"]["feature_layers"] = [0, 1, 7]
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BundleError, match="feature_layers"):
        read_manifest(copy)


def test_errors_say_what_to_do(tmp_path, heads_bundle, trained, trained_eagle3):
    from specdec_edge.export.head_export import add_heads

    with pytest.raises(SpecdecError, match="train-draft --method eagle3"):
        Pipeline.load(heads_bundle, method="eagle3", threads=1)
    with pytest.raises(SpecdecError, match="outputs none; export the model with these heads"):
        add_heads(heads_bundle, [trained_eagle3], tmp_path / "x")


def test_checkpoint_round_trips_in_the_reference_layout(tmp_path, trained, trained_eagle3, plain):
    from click.testing import CliRunner
    from safetensors.numpy import load_file

    from specdec_edge.cli import main
    from specdec_edge.export.eagle3_checkpoint import read_checkpoint
    from specdec_edge.export.head_export import add_heads

    out = tmp_path / "drafter"
    res = CliRunner().invoke(main, ["export-drafter", str(trained_eagle3), "--out", str(out)])
    assert res.exit_code == 0, res.output
    config = json.loads((out / "config.json").read_text())
    assert REFERENCE_CONFIG_KEYS <= set(config) and config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1] and config["draft_vocab_size"] == 200
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(REFERENCE_TENSORS)  # no embed_tokens: the engines share the target's
    assert all(tensors[k].shape == shape(config) for k, shape in REFERENCE_TENSORS.items())
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == np.bool_ and tensors["t2d"].sum() == 200
    ours = load_file(str(trained_eagle3 / "weights.safetensors"))
    target_ids = np.arange(200) + tensors["d2t"]  # what the engines compute from d2t
    assert np.array_equal(target_ids, ours["vocab_ids"]) and np.array_equal(np.flatnonzero(tensors["t2d"]), target_ids)
    # Read back with our reader: the same tensors, bit for bit.
    cfg, back = read_checkpoint(out)
    assert set(back) == set(ours) and all(np.array_equal(back[k], ours[k]) for k in ours)
    assert cfg.feature_layers == [0, 1, 1] and cfg.method == "eagle3" and cfg.draft_vocab == 200
    # ... and as a head: a bundle built from the checkpoint drafts exactly as the one built from the heads folder.
    bundle = add_heads(trained / "target-bundle", [out], tmp_path / "from-checkpoint")
    again, accepted = Pipeline.load(bundle, method="eagle3", threads=1), 0
    for prompt in many_prompts()[:4]:
        a, b = again.generate(prompt, max_new_tokens=24), plain.with_method("eagle3").generate(prompt, 24)
        assert a.token_ids == b.token_ids and a.stats.accepted == b.stats.accepted
        accepted += a.stats.accepted
    assert accepted > 0
    res = CliRunner().invoke(main, ["export-drafter", str(trained / "eagle"), "--out", str(tmp_path / "no")])
    assert res.exit_code == 2 and "train-draft --method eagle3" in res.output


def test_eagle3_training_continues_an_earlier_head(trained, trained_eagle3, prompts_file, tmp_path):
    """--init continues an EAGLE-3 head: its saved fc reads raw features (the training-time scale folded in), so the
    new run unfolds it with its own scale first; with lr 0 the head comes out as it went in, with a learning rate
    it moves, and a head that reads other target layers is refused by name."""
    from safetensors.numpy import load_file

    from specdec_edge.errors import ExportError
    from specdec_edge.export.train_draft import train_draft
    from tests.tiny_models import TRAIN

    target = str(trained / "target-bundle")
    settings = dict(TRAIN, prompts=prompts_file, epochs=1, progress=False)
    same = train_draft("eagle3", target, tmp_path / "a", **dict(settings, lr=0.0), init=trained_eagle3)
    before, after = load_file(str(trained_eagle3 / "weights.safetensors")), load_file(str(same / "weights.safetensors"))
    assert set(before) == set(after)
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)
    assert json.loads((same / "config.json").read_text())["training"]["init"]["folder"] == trained_eagle3.name
    moved = load_file(
        str(train_draft("eagle3", target, tmp_path / "b", **settings, init=trained_eagle3) / "weights.safetensors")
    )
    assert any(not np.array_equal(before[k], moved[k]) for k in before if k != "vocab_ids")

    other = tmp_path / "other-layers"
    shutil.copytree(trained_eagle3, other)
    config = json.loads((other / "config.json").read_text())
    config["feature_layers"] = [layer + 1 for layer in config["feature_layers"]]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="reads target layers"):
        train_draft("eagle3", target, tmp_path / "c", **settings, init=other)
