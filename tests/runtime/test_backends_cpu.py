"""The NVIDIA backends' logic, tested on the CPU: provider options, engine sidecars, the GPU engine's code.

Generated TensorRT profiles and EP options, sidecar validation, the EPContext-on-CPU error, the
onnxruntime/onnxruntime-gpu conflict warning, and OrtGpuEngine's binding/compaction/ping-pong logic
on the CPU (device="cpu") against OrtEngine. What needs the hardware is in tests/runtime/test_gpu.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specdec_edge import Pipeline, SpecdecError
from specdec_edge.api.engines import Engines
from specdec_edge.bundle.hashes import verify_bundle
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.bundle.schema import CacheSpec, GraphSpec
from specdec_edge.errors import BundleError
from specdec_edge.runtime.base import PAD_TO, GpuOptions
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.ort_gpu_engine import OrtGpuEngine, compaction_model
from specdec_edge.runtime.prebuilt import check_sidecar, find_prebuilt
from specdec_edge.runtime.sessions import create_session, ort_package_conflict, session_options
from specdec_edge.runtime.threads import CpuThreads
from specdec_edge.runtime.trt_profiles import tensorrt_ep_options, tensorrt_profiles

ROOT = Path(__file__).resolve().parents[2]


def graph_spec(layers=2, kv_heads=2, head_dim=16, capacity=256, dtype="fp32", flavour="portable") -> GraphSpec:
    cache = CacheSpec(layers, kv_heads, head_dim, capacity, "float16" if dtype == "fp16" else "float32")
    return GraphSpec("target/model.onnx", flavour, dtype, 320, 64, cache)


def parse_profile(text: str) -> dict:
    return {name: tuple(int(d) for d in dims.split("x")) for name, dims in (p.split(":") for p in text.split(","))}


# ---- provider options and profiles
@pytest.mark.parametrize(
    "layers,kvh,hd,cap,dtype,top",
    [
        (2, 2, 16, 256, "fp32", 256),  # the tiny test bundle
        (30, 3, 64, 2048, "fp16", 256),  # SmolLM2-135M, fp16, default capacity
        (18, 1, 256, 4096, "fp16", 256),  # Gemma-3-270M shape
        (2, 2, 16, 48, "fp32", 48),  # capacity below a prefill chunk caps S
    ],
)
def test_tensorrt_ep_options_cover_every_pass(tmp_path, layers, kvh, hd, cap, dtype, top):
    graph = graph_spec(layers, kvh, hd, cap, dtype)
    opts = tensorrt_ep_options(graph, tmp_path)
    mins, opt, maxs = (parse_profile(opts[f"trt_profile_{w}_shapes"]) for w in ("min", "opt", "max"))
    assert (
        set(mins)
        == set(opt)
        == set(maxs)
        == {"input_ids", "position_ids", "attention_bias"}
        | {f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")}
    )
    assert mins["input_ids"] == (1, 1) and maxs["input_ids"] == (1, top) == maxs["position_ids"]
    assert mins["attention_bias"] == (1, 1, 1, 1) and maxs["attention_bias"] == (1, 1, top, cap)
    for name in mins:
        assert all(a <= b <= c for a, b, c in zip(mins[name], opt[name], maxs[name])), name
    assert opt["input_ids"] == (1, min(PAD_TO, top))  # the padded decode pass every GPU step runs
    assert mins["past_key_values.0.key"] == maxs[f"past_key_values.{layers - 1}.value"] == (1, kvh, cap, hd)
    assert opts["trt_fp16_enable"] == ("1" if dtype == "fp16" else "0")
    assert opts["trt_engine_cache_enable"] == "1" and opts["trt_engine_cache_path"] == str(tmp_path)
    assert tensorrt_ep_options(graph, tmp_path, fp16=True)["trt_fp16_enable"] == "1"


def test_profile_covers_every_input_of_an_exported_graph(tmp_path, portable_bundle):
    import onnx

    graph = read_manifest(portable_bundle).target.graph
    model = onnx.load(portable_bundle / graph.path, load_external_data=False)
    inputs = {i.name: [d.dim_value or None for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    profile = parse_profile(tensorrt_ep_options(graph, tmp_path)["trt_profile_max_shapes"])
    assert set(profile) | {"logits_to_keep"} == set(inputs)
    for name, dims in profile.items():
        assert len(dims) == len(inputs[name]) and all(d is None or d == m for d, m in zip(inputs[name], dims)), name


def test_profiles_follow_max_verify():
    big = tensorrt_profiles(graph_spec(capacity=2048), max_verify=300)
    assert big["input_ids"][2] == (1, 300) and big["attention_bias"][2] == (1, 1, 300, 2048)


def test_ort_flavour_is_refused_for_tensorrt(tmp_path, tiny_bundle):
    with pytest.raises(SpecdecError, match="--flavour portable"):
        tensorrt_ep_options(graph_spec(flavour="ort"), tmp_path)
    with pytest.raises(SpecdecError, match="--flavour portable"):
        Pipeline.load(tiny_bundle, provider="tensorrt")


# ---- engine sidecars
SIDECAR = {
    "format": 2,
    "file": "trt/x/target.plan",
    "library": "tensorrt",
    "library_version": "10.3.0",
    "gpu": "Orin",
    "compute_capability": "8.7",
    "hardware_compatibility": "none",
    "source_sha256": "abc",
}


def test_sidecar_accepts_the_machine_it_was_built_on():
    check_sidecar(SIDECAR, version="10.3.0", compute_capability="8.7", source_sha256="abc")
    ampere = {**SIDECAR, "hardware_compatibility": "ampere_plus"}
    check_sidecar(ampere, version="10.3.0", compute_capability="9.0", source_sha256="abc")


@pytest.mark.parametrize(
    "sidecar,here,match",
    [
        (SIDECAR, dict(version="10.13.3", compute_capability="8.7", source_sha256="abc"), "TensorRT 10.3.0"),
        (SIDECAR, dict(version="10.3.0", compute_capability="9.0", source_sha256="abc"), "compute capability 8.7"),
        (
            {**SIDECAR, "hardware_compatibility": "ampere_plus"},
            dict(version="10.3.0", compute_capability="7.5", source_sha256="abc"),
            "Ampere and newer",
        ),
        (SIDECAR, dict(version="10.3.0", compute_capability="8.7", source_sha256="def"), "another version"),
        (
            {**SIDECAR, "format": 99},
            dict(version="10.3.0", compute_capability="8.7", source_sha256="abc"),
            "format",
        ),
    ],
)
def test_sidecar_mismatch_says_rebuild(sidecar, here, match):
    with pytest.raises(BundleError, match=match) as err:
        check_sidecar(sidecar, **here)
    assert "specdec-edge build-engines" in str(err.value)


def test_trt_provider_without_engines_says_build_them(tiny_bundle):
    assert find_prebuilt(tiny_bundle, "target", "tensorrt") is None
    with pytest.raises(BundleError, match="build-engines"):
        Pipeline.load(tiny_bundle, provider="trt")


def test_prebuilt_engine_lookup_checks_the_running_gpu_and_tensorrt(tmp_path, tiny_bundle, monkeypatch):
    from specdec_edge.export.build_engines import register_engines

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA Jetson Orin, 8.7'\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.3.0"))
    bundle = Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))
    manifest = read_manifest(bundle)
    rel = "trt/nvidia-jetson-orin_10.3.0/target.plan"
    (bundle / rel).parent.mkdir(parents=True)
    (bundle / rel).write_bytes(b"plan")
    sidecar = {**SIDECAR, "source_sha256": manifest.files[manifest.target.graph.path]["sha256"]}
    Path(bundle / f"{rel}.json").write_text(json.dumps(sidecar))
    register_engines(bundle, [{"kind": "tensorrt", "role": "target", "file": rel, "sidecar": f"{rel}.json"}])
    assert find_prebuilt(bundle, "target", "tensorrt", manifest.target.graph, required=True)["file"] == rel
    assert find_prebuilt(bundle, "draft", "tensorrt", manifest.draft.graph) is None
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.13.3"))
    assert find_prebuilt(bundle, "target", "tensorrt", manifest.target.graph) is None
    with pytest.raises(BundleError, match="built with TensorRT 10.3.0.*build-engines"):
        find_prebuilt(bundle, "target", "tensorrt", manifest.target.graph, required=True)


def test_build_engines_writes_engines_and_manifest_atomically(tmp_path, portable_bundle, monkeypatch):
    """The bundle bookkeeping of build-engines, with the two GPU builders replaced by file writers."""
    from specdec_edge.export import build_engines

    monkeypatch.setattr(build_engines, "import_library", lambda lib: types.SimpleNamespace(__version__="10.3.0"))
    monkeypatch.setattr(build_engines, "gpu_info", lambda: {"name": "NVIDIA Jetson Orin", "compute_capability": "8.7"})
    monkeypatch.setattr(build_engines, "build_plan", lambda src, graph, out, **kw: out.write_bytes(b"plan"))
    monkeypatch.setattr(build_engines, "build_ep_context", lambda src, graph, out, **kw: out.write_bytes(b"ctx"))
    bundle = Path(shutil.copytree(portable_bundle, tmp_path / "bundle"))
    folder = build_engines.build_engines(bundle, backends=("trt", "tensorrt"), max_verify=16, echo=lambda line: None)
    assert folder == bundle / "trt/nvidia-jetson-orin_10.3.0"
    assert sorted(p.name for p in folder.iterdir()) == [
        "target.epctx.onnx",
        "target.epctx.onnx.json",
        "target.plan",
        "target.plan.json",
    ]
    assert [p.name for p in (bundle / "trt").iterdir()] == [folder.name]  # no scratch left
    assert verify_bundle(bundle) == []
    engines = json.loads((bundle / "manifest.json").read_text())["engines"]
    assert {(e["kind"], e["role"]) for e in engines} == {("tensorrt", "target"), ("ort-epcontext", "target")}
    plan = json.loads((folder / "target.plan.json").read_text())
    assert plan["profile"]["input_ids"][2] == [1, 64] and plan["precision"] == "fp32"
    assert (plan["library"], plan["library_version"], plan["compute_capabilities"]) == ("tensorrt", "10.3.0", ["8.7"])
    assert plan["source_sha256"] == read_manifest(bundle).files["target/model.onnx"]["sha256"]

    def fail(*args, **kwargs):
        raise RuntimeError("builder crashed")

    monkeypatch.setattr(build_engines, "build_ep_context", fail)
    with pytest.raises(RuntimeError):
        build_engines.build_engines(bundle, backends=("tensorrt",), echo=lambda line: None)
    assert verify_bundle(bundle) == [] and [p.name for p in (bundle / "trt").iterdir()] == [folder.name]


# ---- EPContext models on a machine without TensorRT
def epcontext_model(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node(
        "EPContext",
        ["input_ids"],
        ["logits"],
        domain="com.microsoft",
        embed_mode=1,
        ep_cache_context=b"engine bytes",
        source="TensorrtExecutionProvider",
    )
    graph = helper.make_graph(
        [node],
        "ctx",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "s", 320])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def test_epcontext_bundle_on_cpu_is_a_clear_error(tmp_path, tiny_bundle):
    from specdec_edge.export.build_engines import register_engines

    bundle = Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))
    manifest = read_manifest(bundle)
    rel = "trt/nvidia-orin_10.3.0/target.epctx.onnx"
    ctx = epcontext_model(bundle / rel)
    Path(f"{ctx}.json").write_text(json.dumps(SIDECAR))
    register_engines(bundle, [{"kind": "ort-epcontext", "role": "target", "file": rel, "sidecar": f"{rel}.json"}])
    assert verify_bundle(bundle) == []
    for engine in (OrtEngine, OrtGpuEngine):
        with pytest.raises(SpecdecError, match="EPContext model.*provider='tensorrt'.*build-engines"):
            engine(ctx, manifest.target.graph, provider="cpu", **({"device": "cpu"} if engine is OrtGpuEngine else {}))
    # The bundle's ONNX graphs still serve the CPU.
    assert Pipeline.load(bundle, method="plain", threads=1).generate("The quick", max_new_tokens=3).token_ids


# ---- package conflict, light imports, CLI, the check script
def test_onnxruntime_package_conflict_is_detected():
    assert ort_package_conflict(["onnxruntime"]) is None
    message = ort_package_conflict(["onnxruntime", "onnxruntime-gpu"])
    assert "pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu" in message


def test_conflict_warns_at_import_and_gpu_modules_stay_light():
    code = """
import importlib.metadata as md, sys, warnings
real = md.distribution
md.distribution = lambda name: real("onnxruntime") if name in ("onnxruntime", "onnxruntime-gpu") else real(name)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import specdec_edge.runtime, specdec_edge.runtime.ort_gpu_engine, specdec_edge.runtime.tensorrt_engine
print("WARN", [str(w.message) for w in caught if w.category is RuntimeWarning])
heavy = ("torch", "transformers", "onnx", "tensorrt", "cuda")
print("HEAVY", sorted(m for m in sys.modules if m.split(".")[0] in heavy))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "several ONNX Runtime packages" in res.stdout and "HEAVY []" in res.stdout


def test_build_engines_cli_errors_are_clear(tiny_bundle, portable_bundle):
    from specdec_edge.cli import main

    res = CliRunner().invoke(main, ["build-engines", str(tiny_bundle)])
    assert res.exit_code == 2 and "--flavour portable" in res.output
    if shutil.which("nvidia-smi") is None:
        res = CliRunner().invoke(main, ["build-engines", str(portable_bundle)])
        assert res.exit_code == 2 and ("tensorrt" in res.output or "GPU" in res.output)


def test_gpu_check_script_reports_what_is_missing():
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA driver; the script would run the full check")
    res = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh")], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "missing" in res.stdout + res.stderr and "nvidia-smi" in res.stdout + res.stderr


def test_gpu_check_python_half_runs_its_cpu_reference_row(tmp_path, tiny_llama_dir):
    """The table code of scripts/gpu_check.py, on the CPU row every run has (no GPU backend given), written to
    the results folder given to it."""
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts/gpu_check.py"), "", str(tmp_path / "out"), "", str(tiny_llama_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["backends.md"]  # the GPU sections need a GPU
    lines = (tmp_path / "out/backends.md").read_text().splitlines()
    row = next(line for line in lines if line.startswith("| cpu | ort-fp32 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[5:7] == ["6/6", "6/6"] and float(cells[4]) == 0.0  # exact vs itself; pld, lookahead == plain


# ---- OrtGpuEngine logic on the CPU, against OrtEngine
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_compaction_graph_is_valid_onnx_and_moves_slots_in_place(dtype):
    import onnx
    import onnxruntime as ort

    name = np.dtype(dtype).name
    onnx.checker.check_model(onnx.load_from_string(compaction_model(name)), full_check=True)
    cache = np.random.default_rng(0).standard_normal((2, 2, 1, 2, 12, 4)).astype(dtype)
    want = cache.copy()
    want[..., 3:6, :] = cache[..., [3, 5, 8], :]
    value = ort.OrtValue.ortvalue_from_shape_and_type(cache.shape, dtype, "cpu", 0)  # bound by pointer, as on a GPU
    value.update_inplace(cache)
    session = create_session(compaction_model(name), session_options(1), "cpu")
    binding = session.io_binding()
    binding.bind_input("cache", "cpu", 0, dtype, cache.shape, value.data_ptr())
    binding.bind_output("cache_out", "cpu", 0, dtype, cache.shape, value.data_ptr())
    binding.bind_cpu_input("src", np.array([3, 5, 8]))
    binding.bind_cpu_input("dst", np.array([3, 4, 5]).reshape(1, 1, 1, 1, 3, 1))
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(value.numpy(), want)


def drive(engine) -> list[np.ndarray]:
    """Prefill, a chain with rollback, a tree with compaction, then decoding after it (logits copied: an
    engine may reuse its output buffer in the next run)."""
    from specdec_edge.runtime.base import causal_bias

    outs = [engine.run([5, 9, 17, 33, 2, 8, 41], logits_to_keep=1).logits.copy()]
    engine.commit(7)
    outs.append(engine.run([11, 12, 13]).logits.copy())
    engine.commit(2)
    engine.rollback(8)
    # tree: root 20 with children 21, 22; 23 under 22 -> accept path [0, 2, 3]
    bias = causal_bias(8, 4)
    bias[0, 0, :, 8:] = -np.inf
    for node, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 2, 3]]):
        bias[0, 0, node, [8 + a for a in ancestors]] = 0
    outs.append(engine.run([20, 21, 22, 23], position_ids=np.array([8, 9, 9, 10]), attention_bias=bias).logits.copy())
    engine.commit(3, path=np.array([0, 2, 3]))
    outs.append(engine.run([30, 31]).logits.copy())
    engine.commit(2)
    outs.append(engine.run([32]).logits.copy())
    assert engine.length == 13
    return outs


@pytest.mark.parametrize("which", ["tiny", "portable"])
@pytest.mark.parametrize("ping_pong", [False, True])
def test_gpu_engine_logic_matches_the_cpu_engine(which, ping_pong, tiny_bundle, portable_bundle):
    bundle = tiny_bundle if which == "tiny" else portable_bundle
    graph = read_manifest(bundle).target.graph
    want = drive(OrtEngine(bundle / graph.path, graph, cpu=CpuThreads(1)))
    gpu = GpuOptions(ping_pong=ping_pong)
    got = drive(OrtGpuEngine(bundle / graph.path, graph, provider="cpu", device="cpu", threads=1, gpu=gpu))
    for a, b in zip(want, got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pad_to", [8, 16])
def test_padded_passes_give_the_same_logits(pad_to, tiny_bundle, portable_bundle):
    for bundle in (tiny_bundle, portable_bundle):
        graph = read_manifest(bundle).target.graph
        want = drive(OrtEngine(bundle / graph.path, graph, cpu=CpuThreads(1)))
        engine = OrtGpuEngine(
            bundle / graph.path, graph, provider="cpu", device="cpu", threads=1, gpu=GpuOptions(pad_to=pad_to)
        )
        got = drive(engine)
        assert [g.shape for g in got] == [w.shape for w in want]
        for a, b in zip(want, got):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_pad_step_masks_padding_both_ways():
    from specdec_edge.runtime.base import StepInputs, causal_bias, pad_step

    step = StepInputs(np.array([[7, 8]]), np.array([[3, 4]]), causal_bias(3, 2), keep=1)
    padded = pad_step(step, 5, past=3)
    assert padded.ids.tolist() == [[7, 8, 0, 0, 0]] and padded.positions.tolist() == [[3, 4, 4, 4, 4]]
    assert padded.keep == 4  # the last real row and the 3 padding rows; the engine returns the first
    seen = np.isfinite(padded.bias[0, 0])
    assert not seen[:2, 5:].any()  # real rows never see padding
    assert seen[:2, :5].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    for r in range(2, 5):  # padding sees the cache and itself
        assert seen[r].tolist() == [c < 3 or c == 3 + r for c in range(8)]
    assert pad_step(step, 2, past=3) is step


def test_cuda_refuses_an_fp32_ort_graph(tiny_bundle, monkeypatch):
    import onnxruntime as ort

    graph = read_manifest(tiny_bundle).target.graph
    # The refusal comes before any session is made, so a CPU-only onnxruntime that claims CUDA shows it.
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(SpecdecError, match="--dtype fp16"):
        OrtGpuEngine(tiny_bundle / graph.path, graph, provider="cuda")


@pytest.mark.parametrize("pad_to", [0, 8])
def test_gpu_engine_pipeline_is_exact_on_cpu(pad_to, tiny_bundle):
    manifest = read_manifest(tiny_bundle)
    engines = [
        OrtGpuEngine(
            tiny_bundle / m.graph.path,
            m.graph,
            provider="cpu",
            device="cpu",
            threads=1,
            share_process=True,
            gpu=GpuOptions(pad_to=pad_to),
        )
        for m in (manifest.target, manifest.draft)
    ]
    ref = Pipeline.load(tiny_bundle, method="plain", threads=1)
    pipe = Pipeline(ref.tokenizer, Engines(engines[0], engines[1]), "draft", 4)
    for prompt in ("The quick brown fox", "def add(a, b):"):
        assert pipe.generate(prompt, max_new_tokens=24).token_ids == ref.generate(prompt, max_new_tokens=24).token_ids


# ---- fixed-shape passes (what CUDA graphs replay), on the CPU
@pytest.mark.parametrize("pad_to", [8, 16])
def test_fixed_shape_passes_give_the_same_logits_bit_for_bit(pad_to, tiny_bundle, heads_bundle):
    """Every pass of <= pad_to rows runs with [1, pad_to] inputs and a bias over the whole capacity; the graph
    reads the valid length from the bias's values, so logits and cache equal the variable-shape engine's."""
    for bundle in (tiny_bundle, heads_bundle):
        graph = read_manifest(bundle).target.graph
        assert graph.capacity_bias
        engines = [
            OrtGpuEngine(
                bundle / graph.path, graph, provider="cpu", device="cpu", threads=1, gpu=GpuOptions(pad_to=pad_to, **kw)
            )
            for kw in ({}, {"fixed_shape": True})
        ]
        want, got = drive(engines[0]), drive(engines[1])
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(engines[0].cache.numpy(), engines[1].cache.numpy())
        assert engines[1].fixed_passes == engines[1].passes == 5  # the 7-token prefill too (<= pad_to)


def fixed_shape_engine(bundle):
    """The GPU engine's fixed-shape pass (what CUDA graphs replay), emulated on the CPU, one-row passes padded to 16."""
    graph = read_manifest(bundle).target.graph
    gpu = GpuOptions(pad_to=16, fixed_shape=True)
    return OrtGpuEngine(bundle / graph.path, graph, provider="cpu", device="cpu", threads=1, gpu=gpu)


def test_fixed_shape_pipeline_is_exact_and_keeps_one_shape(tiny_bundle, heads_bundle):
    """Generation through fixed-shape passes equals plain CPU decoding, for a chain (pld), a tree (lookahead)
    and hidden-state heads (eagle); only passes wider than pad_to (long prefill) run outside the fixed shape."""
    for bundle, methods in ((tiny_bundle, ("plain", "pld", "lookahead")), (heads_bundle, ("eagle",))):
        engine = fixed_shape_engine(bundle)
        ref = Pipeline.load(bundle, method="plain", threads=1)
        for method in methods:
            pipe = Pipeline(
                ref.tokenizer, Engines(engine, heads=ref.engines.heads if method == "eagle" else None), method, 4
            )
            engine.passes = engine.fixed_passes = 0  # count generation only (not the verdict measured on this engine)
            for prompt in ("The quick brown fox The quick brown fox", "def add(a, b):"):
                want = ref.generate(prompt, max_new_tokens=24).token_ids
                assert pipe.generate(prompt, max_new_tokens=24).token_ids == want, (method, prompt)
        assert engine.fixed_passes == engine.passes > 0


def test_fixed_shape_pipeline_runs_eagle3_heads_exactly(eagle3_bundle):
    """EAGLE-3 heads read the target's layer features: the fixed-shape pass (what CUDA graphs replay) returns them
    too, so eagle3 and pld-eagle3 through it equal plain CPU decoding."""
    assert read_manifest(eagle3_bundle).target.graph.feature_layers
    engine = fixed_shape_engine(eagle3_bundle)
    ref = Pipeline.load(eagle3_bundle, method="plain", threads=1)
    for method in ("eagle3", "pld-eagle3"):
        pipe = Pipeline(ref.tokenizer, Engines(engine, heads=ref.engines.heads), method, 4)
        engine.passes = engine.fixed_passes = 0  # count generation only (not the verdict measured on this engine)
        for prompt in ("The quick brown fox The quick brown fox", "def add(a, b):"):
            result = pipe.generate(prompt, max_new_tokens=24)
            assert result.token_ids == ref.generate(prompt, max_new_tokens=24).token_ids, (method, prompt)
    assert engine.fixed_passes == engine.passes > 0


def test_fixed_shape_and_cuda_graph_are_refused_with_the_fix(tiny_bundle, portable_bundle):
    import dataclasses

    graph = read_manifest(tiny_bundle).target.graph
    path = tiny_bundle / graph.path
    old = dataclasses.replace(graph, capacity_bias=False)  # a bundle exported before fixed-shape passes
    with pytest.raises(SpecdecError, match="Re-export"):
        OrtGpuEngine(path, old, provider="cpu", device="cpu", gpu=GpuOptions(pad_to=8, fixed_shape=True))
    portable = read_manifest(portable_bundle).target.graph
    assert not portable.capacity_bias
    with pytest.raises(SpecdecError, match="pad_to > 0"):
        OrtGpuEngine(path, graph, provider="cpu", device="cpu", gpu=GpuOptions(pad_to=0, fixed_shape=True))
    with pytest.raises(SpecdecError, match="provider 'cuda'"):
        OrtGpuEngine(path, graph, provider="cpu", device="cpu", gpu=GpuOptions(pad_to=8, cuda_graph=True))
    with pytest.raises(SpecdecError, match="in-place cache"):
        OrtGpuEngine(
            path, graph, provider="cpu", device="cpu", gpu=GpuOptions(pad_to=8, ping_pong=True, fixed_shape=True)
        )
    with pytest.raises(SpecdecError, match="provider 'cuda'"):
        Pipeline.load(tiny_bundle, method="plain", cuda_graph=True)


def test_widen_bias_masks_the_rest_of_the_cache():
    from specdec_edge.runtime.base import StepInputs, causal_bias, widen_bias

    step = StepInputs(np.array([[7, 8]]), np.array([[3, 4]]), causal_bias(3, 2), keep=2)
    wide = widen_bias(step, 10)
    assert wide.bias.shape == (1, 1, 2, 10)
    np.testing.assert_array_equal(wide.bias[..., :5], step.bias)
    assert np.isneginf(wide.bias[..., 5:]).all()
