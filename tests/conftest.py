"""Session fixtures: tiny random-weight models and the bundles exported from them; gpu/trt marker skips."""

from __future__ import annotations

import functools
import importlib.util
import os
import tempfile

import pytest

from tests.tiny_models import BASE_GEMMA3, TRAIN, make_model

# What the package caches per machine (measured step costs, the default bundle) goes to a fresh folder, not
# the user's: every test session measures anew, and CLI subprocesses inherit it.
os.environ["SPECDEC_EDGE_CACHE"] = tempfile.mkdtemp(prefix="specdec-edge-test-cache-")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", layers=2, seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("models") / "tiny-draft", "llama", layers=1, seed=1)


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tiny_llama_dir, tiny_draft_dir):
    """Target + draft, ort flavour, fp32, capacity 256."""
    from specdec_edge.export.exporter import export_bundle

    out = tmp_path_factory.mktemp("bundles") / "tiny"
    return export_bundle(str(tiny_llama_dir), out, draft=str(tiny_draft_dir), capacity=256, progress=False)


@pytest.fixture(scope="session")
def int4_bundle(tmp_path_factory, tiny_llama_dir):
    """Target only, ort flavour, 4-bit layers (so a prefill graph: export/prefill_graph.py), capacity 256."""
    from specdec_edge.export.exporter import export_bundle

    out = tmp_path_factory.mktemp("bundles") / "int4"
    return export_bundle(str(tiny_llama_dir), out, dtype="int4", capacity=256, progress=False)


@pytest.fixture(scope="session")
def tiny_self_bundle(tmp_path_factory, tiny_llama_dir):
    """Draft == target: every proposal must be accepted."""
    from specdec_edge.export.exporter import export_bundle

    out = tmp_path_factory.mktemp("bundles") / "tiny-self"
    return export_bundle(str(tiny_llama_dir), out, draft=str(tiny_llama_dir), capacity=256, progress=False)


@pytest.fixture(scope="session")
def chatty_dir(tmp_path_factory, tiny_llama_dir):
    """The tiny model taught to write requests in its user turn and answer them (``tiny_models.chatty_model``)."""
    from tests.tiny_models import chatty_model

    return chatty_model(tmp_path_factory.mktemp("models") / "chatty", tiny_llama_dir)


@pytest.fixture(scope="session")
def base_gemma_dir(tmp_path_factory):
    """A tiny random Gemma 3 base model: tied embeddings, no chat template."""
    return make_model(tmp_path_factory.mktemp("models") / "base-gemma3", **BASE_GEMMA3)


@pytest.fixture(scope="session")
def base_gemma_bundle(tmp_path_factory, base_gemma_dir):
    from specdec_edge.export.exporter import export_bundle

    out = tmp_path_factory.mktemp("bundles") / "base-gemma3"
    return export_bundle(str(base_gemma_dir), out, capacity=256, progress=False)


@functools.cache
def gpu_missing() -> str | None:
    """Why `gpu` tests cannot run here, or None: they need onnxruntime's CUDA EP and a visible NVIDIA GPU."""
    import onnxruntime as ort

    from specdec_edge.errors import SpecdecError
    from specdec_edge.runtime.prebuilt import gpu_info

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "no CUDAExecutionProvider in this onnxruntime (install onnxruntime-gpu)"
    try:
        gpu_info()
    except SpecdecError as e:
        return str(e)
    return None


@functools.cache
def trt_missing() -> str | None:
    """Why `trt` tests cannot run here, or None: they need a GPU and the tensorrt package."""
    if importlib.util.find_spec("tensorrt") is None:
        return "the tensorrt Python package is not installed"
    return gpu_missing()


@functools.cache
def trt_rtx_missing() -> str | None:
    """Why `trt_rtx` tests cannot run here, or None: they need the tensorrt_rtx module (`[trt-rtx]` extra).
    It imports and builds engines ahead of time without a GPU; tests that run engines are also marked `gpu`."""
    if importlib.util.find_spec("tensorrt_rtx") is None:
        return "the tensorrt_rtx Python package is not installed (pip install 'specdec-edge[trt-rtx]')"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, missing in (("gpu", gpu_missing), ("trt", trt_missing), ("trt_rtx", trt_rtx_missing)):
            if item.get_closest_marker(marker) and (reason := missing()):
                item.add_marker(pytest.mark.skip(reason=f"needs {marker}: {reason}"))


@pytest.fixture(scope="session")
def portable_bundle(tmp_path_factory, tiny_llama_dir):
    from specdec_edge.export.exporter import export_bundle

    out = tmp_path_factory.mktemp("bundles") / "portable"
    return export_bundle(str(tiny_llama_dir), out, flavour="portable", capacity=64, progress=False)


@pytest.fixture(scope="session")
def ort_fp16_bundle(tmp_path_factory, tiny_llama_dir):
    """The fused-attention graph in fp16: what the CUDA EP runs (its GroupQueryAttention has no fp32 kernel)."""
    from specdec_edge.export.exporter import export_bundle

    out = tmp_path_factory.mktemp("bundles") / "ort-fp16"
    return export_bundle(str(tiny_llama_dir), out, dtype="fp16", capacity=64, progress=False)


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    """A text file of prompts, one a line, for training tiny heads."""
    from tests.speculative.test_methods import many_prompts

    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(str(p) for p in many_prompts(12, seed=3) if isinstance(p, str)) + "\n")
    return path


@pytest.fixture(scope="session")
def trained(tmp_path_factory, tiny_llama_dir, prompts_file):
    """Work folder with eagle and medusa heads trained on the tiny target's own answers."""
    from specdec_edge.export.train_draft import train_draft

    out = tmp_path_factory.mktemp("heads-work")
    for method in ("eagle", "medusa"):
        train_draft(method, str(tiny_llama_dir), out, prompts=prompts_file, **TRAIN)
    return out


@pytest.fixture(scope="session")
def heads_bundle(tmp_path_factory, tiny_llama_dir, trained):
    """The tiny target with both trained heads (default method pld-eagle), capacity 256."""
    from specdec_edge.export.exporter import export_bundle

    out = tmp_path_factory.mktemp("bundles") / "tiny-heads"
    return export_bundle(
        str(tiny_llama_dir), out, capacity=256, heads=(trained / "eagle", trained / "medusa"), progress=False
    )


@pytest.fixture(scope="session")
def trained_eagle3(trained, prompts_file):
    """An EAGLE-3 head trained in the ``trained`` work folder (same target bundle and answers)."""
    from specdec_edge.export.train_draft import train_draft

    return train_draft("eagle3", str(trained / "target-bundle"), trained, prompts=prompts_file, **TRAIN)


@pytest.fixture(scope="session")
def eagle3_bundle(tmp_path_factory, tiny_llama_dir, trained_eagle3):
    """The tiny target with the trained EAGLE-3 head (its feature layers exposed), capacity 256."""
    from specdec_edge.export.exporter import export_bundle

    out = tmp_path_factory.mktemp("bundles") / "tiny-eagle3"
    return export_bundle(str(tiny_llama_dir), out, capacity=256, heads=(trained_eagle3,), progress=False)


@pytest.fixture(scope="session")
def wide_heads_bundle(tmp_path_factory):
    """Attention heads 256 wide in the portable flavour (standard MatMuls): MLAS sums Q.K^T in one block of the
    head size while a pass holds at most 128 keys here, and in blocks beyond: passes round differently there."""
    from specdec_edge.export.exporter import export_bundle

    model = make_model(tmp_path_factory.mktemp("models") / "wide-heads", "llama", layers=2, seed=0, hidden_size=256,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=256)  # fmt: skip
    out = tmp_path_factory.mktemp("bundles") / "wide-heads"
    return export_bundle(str(model), out, capacity=512, flavour="portable", progress=False)
