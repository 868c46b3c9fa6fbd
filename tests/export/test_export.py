"""Export: every registered architecture in both flavours, the bundle contract, and bad inputs."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from specdec_edge.bundle.hashes import verify_bundle
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.cli import main
from specdec_edge.export.arch import REGISTRY
from specdec_edge.export.exporter import export_bundle
from tests.speculative.test_methods import many_prompts
from tests.tiny_models import make_model

MANY = many_prompts(8, seed=11)

# One tiny model family per registered architecture (checked below so none is forgotten).
FAMILIES = {"llama": ["llama", "mistral", "qwen2"], "gemma3": ["gemma3"]}


def test_every_registered_architecture_is_tested():
    assert set(FAMILIES) == set(REGISTRY)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {kind: make_model(root / kind, kind, layers=2, seed=3) for kinds in FAMILIES.values() for kind in kinds}


@pytest.mark.parametrize("flavour", ["ort", "portable"])
@pytest.mark.parametrize("kind", [k for kinds in FAMILIES.values() for k in kinds])
def test_export_validates_each_family(family_dirs, tmp_path, kind, flavour):
    out = export_bundle(str(family_dirs[kind]), tmp_path / "b", flavour=flavour, capacity=64, progress=False)
    m = read_manifest(out)
    v = m.target.validation
    for key in ("prefill_last_max_abs_err", "s1_max_abs_err", "s5_max_abs_err", "tree_max_abs_err"):
        assert v[key] < 1e-4, (key, v)
    assert v["top1_agreement"] == 1.0
    assert m.target.graph.flavour == flavour
    assert m.target.architecture == ("gemma3" if kind == "gemma3" else "llama")
    graph = onnx.load(str(out / m.target.graph.path), load_external_data=False)
    domains = {n.domain for n in graph.graph.node}
    if flavour == "portable":
        assert domains == {""}, "portable graphs use standard ONNX ops only"
        onnx.checker.check_model(str(out / m.target.graph.path), full_check=True)
    else:
        assert any(n.op_type == "GroupQueryAttention" for n in graph.graph.node)
    assert verify_bundle(out) == []


def test_manifest_contract(tiny_bundle):
    data = json.loads((tiny_bundle / "manifest.json").read_text())
    assert data["schema_version"] == 2
    assert data["exporter"]["name"] == "specdec-edge"
    g = data["target"]["graph"]
    # the export machine's exactness verdict, with the device it was measured on (runtime/verdicts.py)
    assert g["batch_invariant"] and g["min_pass_width"] in (1, 2) and g["verdict"]["max_width"] == 64
    assert g["verdict"]["device"]["provider"] == "cpu" and "boundaries" in g["verdict"]["details"]
    names = [i["name"] for i in g["inputs"]]
    assert names[:3] == ["input_ids", "position_ids", "attention_bias"]
    assert g["cache"]["capacity"] == 256 and g["cache"]["in_place"]
    assert {o["name"] for o in g["outputs"]} >= {"logits", "present.0.key", "present.1.value"}
    assert data["draft"]["graph"]["cache"]["num_layers"] == 1
    tok = data["tokenizer"]
    assert tok["chat_template"] and tok["eos_token_ids"] == [2]
    for rel, entry in data["files"].items():
        assert (tiny_bundle / rel).stat().st_size == entry["size"] and len(entry["sha256"]) == 64
    assert {"target/model.onnx", "target/model.onnx.data", "draft/model.onnx", "tokenizer.json"} <= set(data["files"])


@pytest.mark.parametrize("dtype", ["fp16", "int8", "int4"])
def test_precisions_export_validate_and_speculate_exactly(tiny_llama_dir, tmp_path, dtype):
    out = export_bundle(str(tiny_llama_dir), tmp_path / dtype, dtype=dtype, capacity=256, progress=False)
    m = read_manifest(out)
    assert m.target.graph.dtype == dtype
    assert m.target.validation["max_rel_err"] <= m.target.validation["tolerance"]
    ops = {n.op_type for n in onnx.load(str(out / m.target.graph.path), load_external_data=False).graph.node}
    if dtype == "int8":  # int8 weights, every activation row quantized with its own scale
        assert "MatMulInteger" in ops and "DynamicQuantizeLinear" not in ops and "MatMul" not in ops
    if dtype == "int4":
        assert "MatMulNBits" in ops and "MatMul" not in ops
    # Measured at export, not assumed from the dtype: one-row passes are padded to two.
    invariance = m.target.validation["batch_invariance"]
    from specdec_edge import Pipeline, SpecdecError

    if dtype != "fp16":
        assert m.target.graph.verdict.batch_invariant
        assert invariance["failed_widths"] == [] and invariance["max_width"] == 64
    else:  # measured, and applied: passes are cut to the widest width that matched, or speculation is refused
        # On an x86 CPU, ONNX Runtime runs the fp16 MatMuls in fp32 on fp32 copies of the weights
        # (FuseFp16InitializerToFp32NodeTransformer), whose sums differ in the last bits between some passes; the
        # residual stream is fp32 (export/graph.py), so nothing rounds that away. Measured on an AMD EPYC: widths
        # 16 and 32 at short contexts, and two-row passes after some cache lengths in no periodic pattern (the
        # residue sweep of runtime/verdicts.py), so this model's fp16 graph is not batch invariant there.
        assert invariance["max_width"] == m.target.graph.verdict.max_width
        if not m.target.graph.verdict.batch_invariant:
            assert invariance["max_width"] == 1 and 2 in invariance["failed_widths"]
            with pytest.raises(SpecdecError, match="not batch invariant"):
                Pipeline.load(out, method="pld", threads=1)
            return
    assert m.target.graph.verdict.min_pass_width == (1 if invariance["single_row_matches"] else 2)
    from tests.speculative.test_methods import assert_greedy_equals_plain

    plain = Pipeline.load(out, method="plain", threads=1)
    assert_greedy_equals_plain(plain, plain.with_method("pld"), prompts=MANY[:8])  # chains: no allow_inexact needed
    # Trees: exact where their rows are bit-identical to chains, or in float graphs (rounding only); a quantized
    # graph whose tree rows round differently refuses tree methods.
    if m.target.graph.verdict.tree_invariant or dtype == "fp16":
        assert_greedy_equals_plain(plain, plain.with_method("lookahead"), prompts=MANY[:8])
    else:
        with pytest.raises(SpecdecError, match="verifies only chain-shaped proposals"):
            plain.with_method("lookahead")


def test_hidden_states_output(tiny_llama_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from specdec_edge.runtime.ort_engine import OrtEngine

    out = export_bundle(str(tiny_llama_dir), tmp_path / "h", hidden_states=True, capacity=64, progress=False)
    m = read_manifest(out)
    engine = OrtEngine(out / m.target.graph.path, m.target.graph)
    ids = np.array([5, 17, 42, 7, 99])
    got = engine.run(ids).hidden_states
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        want = model(torch.tensor(ids[None]), output_hidden_states=True).hidden_states[-1][0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_failed_validation_leaves_nothing(tiny_llama_dir, tmp_path, monkeypatch):
    from specdec_edge.errors import ExportError
    from specdec_edge.export import validate

    monkeypatch.setitem(validate.TOLERANCE, "fp32", 0.0)  # any nonzero error now fails
    with pytest.raises(ExportError, match="validation failed"):
        export_bundle(str(tiny_llama_dir), tmp_path / "x", capacity=64, progress=False)
    assert list(tmp_path.iterdir()) == []


# ---- bad inputs: one clear line, exit 2, no traceback


def run_cli(*args):
    result = CliRunner().invoke(main, list(map(str, args)))
    return result.exit_code, result.output


def assert_clean_error(code, output, *needles):
    assert code == 2, output
    assert "Traceback" not in output
    errors = [ln for ln in output.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and output.rstrip().endswith(errors[0]), output  # stage lines may precede it
    for needle in needles:
        assert needle in output, (needle, output)


def test_missing_path(tmp_path):
    assert_clean_error(
        *run_cli("export", "--target", tmp_path / "nope.gguf", "--out", tmp_path / "o"), "does not exist"
    )
    assert_clean_error(*run_cli("export", "--target", "./no/such/folder", "--out", tmp_path / "o"), "does not exist")


def test_a_gguf_target_without_dtype_is_told_it_becomes_fp32(tmp_path):
    broken = tmp_path / "model.gguf"
    broken.write_bytes(b"not a gguf file")
    code, out = run_cli("export", "--target", broken, "--out", tmp_path / "o")
    assert "dequantized to fp32" in out and "--dtype gguf" in out  # said before the file is read
    assert_clean_error(code, out)
    code, out = run_cli("export", "--target", broken, "--dtype", "fp32", "--out", tmp_path / "o")
    assert "dequantized to fp32" not in out  # asked for
    assert_clean_error(code, out)


def test_unknown_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path / "gpt2")
    code, out = run_cli("export", "--target", tmp_path / "gpt2", "--out", tmp_path / "o")
    assert_clean_error(code, out, "'gpt2' is not supported", "llama", "gemma3_text", "qwen2", "mistral")
    assert not (tmp_path / "o").exists()


def test_vocab_mismatch(tiny_llama_dir, tmp_path):
    other = make_model(tmp_path / "other", "llama", layers=1, vocab_size=300)
    code, out = run_cli(
        "export", "--target", tiny_llama_dir, "--draft", other, "--out", tmp_path / "o", "--capacity", 256
    )  # within the tiny models' 512 positions
    assert_clean_error(code, out, "does not share the target's vocabulary")
    assert not (tmp_path / "o").exists()


def test_existing_out_dir(tiny_llama_dir, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_clean_error(*run_cli("export", "--target", tiny_llama_dir, "--out", out), "already exists", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    code, text = run_cli("export", "--target", tiny_llama_dir, "--out", out, "--capacity", 64, "--force")
    assert code == 0, text
    assert not (out / "keep.txt").exists() and (out / "manifest.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["o"], "no staging directories left behind"


def test_corrupted_file_detected(tiny_bundle, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_bundle, copy)
    data = copy / "target" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    result = CliRunner().invoke(main, ["verify", str(copy)])
    assert result.exit_code == 1
    assert "target/model.onnx.data" in result.output and "Traceback" not in result.output
    assert run_cli("verify", tiny_bundle)[0] == 0
    # a truncated file is caught on load already (size check)
    data.write_bytes(bytes(raw[:-10]))
    assert_clean_error(*run_cli("info", copy), "target/model.onnx.data", "corrupted")


def test_not_a_bundle(tmp_path):
    assert_clean_error(*run_cli("info", tmp_path), "not a specdec-edge bundle")


def test_info_json(tiny_bundle):
    code, out = run_cli("info", tiny_bundle, "--json")
    assert code == 0
    summary = json.loads(out)
    assert summary["target"]["layers"] == 2 and summary["draft"]["layers"] == 1
    code, out = run_cli("info", tiny_bundle)
    assert code == 0 and "validation vs PyTorch" in out


def test_default_method_is_recorded_and_checked(tiny_llama_dir, tmp_path):
    from specdec_edge import Pipeline
    from specdec_edge.errors import ExportError

    out = export_bundle(str(tiny_llama_dir), tmp_path / "d", default_method="pld", capacity=64, progress=False)
    assert read_manifest(out).default_method == "pld" and Pipeline.load(out, threads=1).method == "pld"
    with pytest.raises(ExportError, match="--default-method 'eagle' cannot run on this bundle; choose one of plain"):
        export_bundle(str(tiny_llama_dir), tmp_path / "e", default_method="eagle", capacity=64, progress=False)


# Sliding windows below the capacity (12 keys of 64), as each model type's transformers attention applies them:
# Mistral on every layer, Qwen2 on the layers past max_window_layers; Llama has none (the value is ignored there).
WINDOWS = [  # (kind, config, the window that applies)
    ("mistral", {"sliding_window": 12}, 12),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}, 12),
    ("llama", {"sliding_window": 12}, None),
    ("mistral", {"sliding_window": 4096}, None),  # beyond the capacity: no key is ever that far back
]


@pytest.mark.parametrize(
    ("kind", "window", "applies"), WINDOWS, ids=[f"{k}-{c['sliding_window']}" for k, c, _ in WINDOWS]
)
def test_sliding_windows_match_transformers_past_the_window(tmp_path, kind, window, applies):
    """Every logit of a 40-token prompt, computed by the exported graph, equals transformers' (the window masks the
    same keys), and the export's validation ran past the window."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec_edge.runtime.ort_engine import OrtEngine

    model_dir = make_model(tmp_path / kind, kind, layers=2, seed=4, **window)
    out = export_bundle(str(model_dir), tmp_path / "b", capacity=64, progress=False)
    m = read_manifest(out)
    assert m.target.validation["prefix_tokens"] == (applies or 9)  # the S=1, S=5 and tree passes past the window
    ids = np.random.default_rng(0).integers(3, 300, 40)
    got = OrtEngine(out / m.target.graph.path, m.target.graph).run(ids).logits
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.as_tensor(ids[None])).logits[0].numpy()
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, f"{kind} {window}: the graph differs from transformers by {err:.3g} past the window"


def test_every_model_type_says_how_it_applies_a_window():
    from specdec_edge.export.arch import WINDOW_RULES, supported_model_types

    assert set(WINDOW_RULES) == set(supported_model_types())
