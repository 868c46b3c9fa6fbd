"""The TensorRT-RTX backend (provider and build-engines backend ``trt-rtx``) on a machine without a GPU.

Sidecar checks, backend selection and their errors run everywhere. Tests marked `trt_rtx` need the
tensorrt_rtx module (``pip install 'specdec-edge[trt-rtx]'``, not installed by CI: a 95 MB download) and
no GPU: TensorRT-RTX builds engines ahead of time for named compute capabilities on any machine.
Running an engine needs an RTX GPU: tests/runtime/test_gpu.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from specdec_edge import Pipeline, SpecdecError
from specdec_edge.bundle.hashes import verify_bundle
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.errors import BundleError, ExportError
from specdec_edge.runtime.prebuilt import check_sidecar, find_prebuilt
from specdec_edge.runtime.trt_libraries import TENSORRT, TENSORRT_RTX, import_library

RTX = {
    "format": 2,
    "file": "trt/cc-8.9-12.0_rtx-1.7.1.116/target.rtx.plan",
    "library": "tensorrt-rtx",
    "library_version": "1.7.1.116",
    "gpu": None,
    "compute_capability": None,
    "compute_capabilities": ["8.9", "12.0"],
    "hardware_compatibility": "none",
    "source_sha256": "abc",
}


def here(version="1.7.1.116", cc="8.9", sha="abc"):
    return dict(version=version, compute_capability=cc, source_sha256=sha, library=TENSORRT_RTX)


# ---- sidecars: library, version, build targets
def test_rtx_sidecar_accepts_each_target_it_was_built_for():
    for cc in ("8.9", "12.0"):
        check_sidecar(RTX, **here(cc=cc))


@pytest.mark.parametrize(
    "sidecar,kwargs,match",
    [
        (RTX, here(version="1.8.0.5"), "built with TensorRT-RTX 1.7.1.116, this machine has TensorRT-RTX 1.8.0.5"),
        (RTX, here(cc="8.6"), "compute capability 8.9, 12.0; this GPU has 8.6.*--compute-capability 8.6"),
        (RTX, here(cc="9.0"), "this GPU has 9.0: TensorRT-RTX builds for 7.5, .* only .*provider 'cuda'"),
        (RTX, {**here(), "library": TENSORRT, "version": "10.3.0"}, "TensorRT-RTX engine.*'trt-rtx'"),
        ({**RTX, "library": "tensorrt"}, here(), "TensorRT engine and TensorRT-RTX cannot load it"),
        (RTX, here(sha="def"), "another version of its ONNX graph"),
    ],
)
def test_rtx_sidecar_mismatch_names_library_version_and_fix(sidecar, kwargs, match):
    with pytest.raises(BundleError, match=match):
        check_sidecar(sidecar, **kwargs)


def test_sidecars_of_another_format_say_rebuild():
    old = {"format": 1, "file": "x.plan", "tensorrt_version": "10.3.0", "compute_capability": "8.7"}
    with pytest.raises(BundleError, match="unknown engine sidecar format 1; .*build-engines"):
        check_sidecar(old, version="10.3.0", compute_capability="8.7", source_sha256=None)


# ---- backend selection and its errors
def test_missing_tensorrt_rtx_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)  # makes `import tensorrt_rtx` fail here
    with pytest.raises(SpecdecError, match=r"tensorrt_rtx.*TensorRT-RTX.*specdec-edge\[trt-rtx\]"):
        import_library(TENSORRT_RTX)


def test_trt_rtx_provider_without_engines_says_build_them(tiny_bundle):
    assert find_prebuilt(tiny_bundle, "target", "tensorrt-rtx") is None
    with pytest.raises(BundleError, match="no tensorrt-rtx engine.*build-engines .* --backend trt-rtx"):
        Pipeline.load(tiny_bundle, provider="trt-rtx")


def test_build_engines_picks_the_installed_library(monkeypatch):
    from specdec_edge.export import build_engines

    for have, want in (
        ({"tensorrt"}, ("trt", "tensorrt")),
        ({"tensorrt_rtx"}, ("trt-rtx",)),
        (set(), ("trt", "tensorrt")),
    ):
        monkeypatch.setattr(build_engines, "installed", lambda lib, have=have: lib.module in have)
        assert build_engines.default_backends() == want


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(backends=("trt-rtx",), hardware_compatible=True), "--compute-capability"),
        (dict(backends=("trt",), compute_capabilities=["8.9"]), "--backend trt-rtx"),
        (dict(backends=("trt", "trt-rtx")), "separate calls"),
    ],
)
def test_build_engines_option_errors(kwargs, match, portable_bundle):
    from specdec_edge.export.build_engines import build_engines

    with pytest.raises(ExportError, match=match):
        build_engines(portable_bundle, echo=lambda line: None, **kwargs)


def test_build_engines_cli_rtx_errors_exit_2(portable_bundle):
    from specdec_edge.cli import main

    args = ["build-engines", str(portable_bundle), "--backend", "trt-rtx", "--hardware-compatible"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "--compute-capability" in res.output and "Traceback" not in res.output


def test_rtx_engines_are_recorded_and_found_for_their_targets(tmp_path, portable_bundle, monkeypatch):
    """Bookkeeping of an ahead-of-time TensorRT-RTX build without a GPU (builder replaced by a file writer), then
    the lookup on machines whose GPU is or is not among the targets."""
    from specdec_edge.export import build_engines

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi: no GPU
    version = types.SimpleNamespace(__version__="1.7.1.116")
    monkeypatch.setattr(build_engines, "import_library", lambda lib: version)
    monkeypatch.setattr(build_engines, "build_plan", lambda src, graph, out, **kw: out.write_bytes(b"plan"))
    bundle = Path(shutil.copytree(portable_bundle, tmp_path / "bundle"))
    folder = build_engines.build_engines(
        bundle, backends=("trt-rtx",), compute_capabilities=["8.9", "12.0"], echo=lambda line: None
    )
    assert folder == bundle / "trt/cc-8.9-12.0_rtx-1.7.1.116"
    assert sorted(p.name for p in folder.iterdir()) == ["target.rtx.plan", "target.rtx.plan.json"]
    assert verify_bundle(bundle) == []
    sidecar = json.loads((folder / "target.rtx.plan.json").read_text())
    assert sidecar["library"] == "tensorrt-rtx" and sidecar["library_version"] == "1.7.1.116"
    assert sidecar["compute_capabilities"] == ["8.9", "12.0"] and sidecar["gpu"] is None

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", version)
    graph = read_manifest(bundle).target.graph
    for gpu, found in (("NVIDIA GeForce RTX 4090, 8.9", True), ("NVIDIA H200, 9.0", False)):
        (fake_bin / "nvidia-smi").write_text(f"#!/bin/sh\necho '{gpu}'\n")
        (fake_bin / "nvidia-smi").chmod(0o755)
        entry = find_prebuilt(bundle, "target", "tensorrt-rtx", graph)
        assert (entry is not None) == found
    with pytest.raises(BundleError, match="built for compute capability 8.9, 12.0; this GPU has 9.0"):
        find_prebuilt(bundle, "target", "tensorrt-rtx", graph, required=True)


# ---- with the real tensorrt_rtx module (no GPU needed)
@pytest.mark.trt_rtx
def test_rtx_builder_targets_and_refusals():
    from specdec_edge.runtime.trt_libraries import rtx_compute_capabilities, set_rtx_targets

    trt = import_library(TENSORRT_RTX)
    supported = rtx_compute_capabilities(trt)
    assert "8.9" in supported and "9.0" not in supported  # Hopper is not an RTX target
    assert not hasattr(trt.BuilderFlag, "FP16") and not hasattr(trt.BuilderFlag, "INT8")  # strongly typed only
    config = trt.Builder(trt.Logger(trt.Logger.ERROR)).create_builder_config()
    set_rtx_targets(trt, config, ["8.6", "12.0"])
    assert config.num_compute_capabilities == 2
    assert config.get_compute_capability(1) == trt.ComputeCapability.SM120
    set_rtx_targets(trt, config, None)
    assert config.num_compute_capabilities == 1 and config.get_compute_capability(0) == trt.ComputeCapability.CURRENT
    with pytest.raises(SpecdecError, match="cannot build for compute capability 9.0; it supports"):
        set_rtx_targets(trt, config, ["9.0"])


@pytest.mark.trt_rtx
def test_rtx_engine_builds_ahead_of_time_without_a_gpu(tmp_path, portable_bundle):
    """A real TensorRT-RTX engine for an RTX 40xx (8.9), built here; loading it needs that GPU and says so."""
    from specdec_edge.cli import main

    bundle = Path(shutil.copytree(portable_bundle, tmp_path / "bundle"))
    args = ["build-engines", str(bundle), "--backend", "trt-rtx", "--compute-capability", "8.9", "--max-verify", "16"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    trt = import_library(TENSORRT_RTX)
    folder = bundle / f"trt/cc-8.9_rtx-{trt.__version__}"
    plan = (folder / "target.rtx.plan").read_bytes()
    assert len(plan) > 10_000 and verify_bundle(bundle) == []
    sidecar = json.loads((folder / "target.rtx.plan.json").read_text())
    assert sidecar["compute_capabilities"] == ["8.9"] and sidecar["profile"]["input_ids"][2] == [1, 64]
    if shutil.which("nvidia-smi") is None:
        with pytest.raises(SpecdecError, match="no NVIDIA GPU found"):
            Pipeline.load(bundle, provider="trt-rtx")
