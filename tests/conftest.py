"""Session fixtures: tiny random-weight models and the bundles exported from them."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_model


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
def tiny_self_bundle(tmp_path_factory, tiny_llama_dir):
    """Draft == target: every proposal must be accepted."""
    from specdec_edge.export.exporter import export_bundle

    out = tmp_path_factory.mktemp("bundles") / "tiny-self"
    return export_bundle(str(tiny_llama_dir), out, draft=str(tiny_llama_dir), capacity=256, progress=False)
