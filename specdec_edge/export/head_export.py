"""Heads into bundles: ONNX export and validation of head graphs, the manifest's ``heads`` section, ``add_heads``.

``export_heads`` turns trained heads folders (``heads_folder.py``) into ONNX graphs inside a
bundle (``heads/<method>.onnx``), each validated against its torch module in ONNX Runtime;
``add_heads`` writes a copy of an existing bundle with heads, atomically. Both the graph and
its manifest entry follow the method's recipe (``head_recipes.py``).
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdec_edge.bundle import StagingDir, read_manifest
from specdec_edge.errors import ExportError
from specdec_edge.export.head_onnx import TOP_K
from specdec_edge.export.head_recipes import HeadRecipe, recipe_for
from specdec_edge.export.heads_folder import load_heads
from specdec_edge.speculative.methods import default_head_method

TOLERANCE = 1e-3  # max |onnx - torch| of predicted features / log-probs, relative to their scale


def _write_graph(graph: nn.Module, recipe: HeadRecipe, example: tuple, path: Path) -> None:
    """Trace ``graph`` on ``example`` into an ONNX file at ``path`` (opset 17, the bundle's IR version)."""
    import onnx

    from specdec_edge.export.graph import IR_VERSION, save

    tmp = path.with_suffix(".tmp.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notices
        torch.onnx.export(
            graph,
            example,
            str(tmp),
            input_names=list(recipe.inputs),
            output_names=list(recipe.outputs),
            dynamic_axes=recipe.dynamic_axes,
            opset_version=17,
            dynamo=False,
        )
    model = onnx.load(str(tmp))
    tmp.unlink()
    model.ir_version = min(model.ir_version, IR_VERSION)
    save(model, path)


def _compare(graph: nn.Module, recipe: HeadRecipe, examples: list[tuple], path: Path) -> dict:
    """Worst relative error per output (and top-1 id agreement) of the ONNX file vs ``graph`` over ``examples``."""
    from specdec_edge.runtime.sessions import create_session
    from specdec_edge.runtime.threads import DEFAULT_THREADS, cpu_session_options

    sess = create_session(path, cpu_session_options(DEFAULT_THREADS), "cpu")
    report: dict = {}
    for example in examples:  # the traced shapes and other ones (dynamic axes)
        with torch.no_grad():
            want = [t.numpy() for t in graph(*example)]
        got = sess.run(None, {n: t.numpy() for n, t in zip(recipe.inputs, example)})
        for name, g, w in zip(recipe.outputs, got, want):
            if name == "topk_ids":
                agree = float(np.mean(g[..., 0] == w[..., 0]))
                report["topk_ids_agreement"] = min(report.get("topk_ids_agreement", 1.0), agree)
                continue
            err = float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-6))
            report[f"{name}_max_rel_err"] = max(report.get(f"{name}_max_rel_err", 0.0), err)
    return report


def export_head_graph(head: nn.Module, path: Path) -> dict:
    """Write ``head`` as an ONNX graph at ``path``; validate it in ONNX Runtime; return the report."""
    recipe = recipe_for(head.cfg.method)
    graph, examples = recipe.graph(head), recipe.examples(head.cfg)
    _write_graph(graph, recipe, examples[0], path)
    report = _compare(graph, recipe, examples, path)
    worst = max(v for k, v in report.items() if k.endswith("err"))
    report["max_rel_err"], report["tolerance"] = worst, TOLERANCE
    if not np.isfinite(worst) or worst > TOLERANCE:
        raise ExportError(
            f"the {recipe.name} head graph differs from PyTorch by {worst:.3g} > {TOLERANCE}; no bundle was written."
        )
    return report


def export_heads(
    heads_dirs, embed: np.ndarray, lm_head: np.ndarray, root: Path, default: str | None = None, chains: bool = False
) -> dict:
    """Build and validate a graph per heads folder under ``root/heads``; the manifest's ``heads`` section.

    ``embed`` and ``lm_head``: the target's [V, H] weights. ``default``: the method a pipeline
    uses when none is asked for (the registry's ``default_head_method``: pld-eagle with EAGLE heads).
    ``chains``: record one-branch tree settings (the target verifies only chains bit for bit).
    """
    section = {}
    (root / "heads").mkdir(exist_ok=True)
    for folder in heads_dirs:
        head = load_heads(Path(folder), embed, lm_head)
        cfg = head.cfg
        if cfg.method in section:
            raise ExportError(f"two {cfg.method} heads folders were given; pass one per method.")
        report = export_head_graph(head, root / "heads" / f"{cfg.method}.onnx")
        config = {k: v for k, v in asdict(cfg).items() if k not in ("method", "training")}
        section[cfg.method] = {
            "graph": f"heads/{cfg.method}.onnx",
            "top_k": TOP_K,
            "config": config,
            "tree": recipe_for(cfg.method).chain if chains else recipe_for(cfg.method).tree,
            "training": cfg.training,
            "validation": report,
        }
    section["default"] = default_head_method(list(section), default)  # the policy lives in the method registry
    return section


def target_weights(bundle: Path) -> tuple[np.ndarray, np.ndarray]:
    """The target's embedding [V, H] and LM head [V, H] read from a bundle's fp32/fp16 graph."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    manifest = read_manifest(bundle)
    graph = manifest.target.graph
    if graph.dtype not in ("fp32", "fp16"):
        raise ExportError(
            f"bundle {bundle} has {graph.dtype} weights; heads need an fp32 or fp16 target bundle "
            "(export one with --dtype fp32 --hidden-states)."
        )
    path = Path(bundle) / graph.path
    model = onnx.load(str(path), load_external_data=False)  # read only the two tensors needed
    found = {i.name: i for i in model.graph.initializer if i.name in ("model.embed_tokens.weight", "lm_head.weight.T")}
    for tensor in found.values():
        if uses_external_data(tensor):
            load_external_data_for_tensor(tensor, str(path.parent))
    embed = numpy_helper.to_array(found["model.embed_tokens.weight"]).astype(np.float32)  # [V, H]
    head = numpy_helper.to_array(found["lm_head.weight.T"]).astype(np.float32).T  # [V, H]
    return embed, np.ascontiguousarray(head)


def add_heads(bundle: str | Path, heads_dirs, out: str | Path, force: bool = False, default: str | None = None) -> Path:
    """Write a copy of ``bundle`` with head graphs at ``out`` (staged, then renamed into place)."""
    bundle, out = Path(bundle), Path(out)
    manifest = read_manifest(bundle)
    if not manifest.target.graph.has_hidden_states:
        raise ExportError(
            f"bundle {bundle} has no hidden_states output; heads read it. Re-export with --hidden-states."
        )
    if out.resolve() == bundle.resolve():
        raise ExportError("--out must differ from the source bundle; the new bundle is written beside it.")
    embed, lm_head = target_weights(bundle)
    with StagingDir(out, force) as staging:
        for rel in manifest.files:
            if rel.startswith("heads/"):
                continue
            dest = staging.path / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(bundle / rel, dest)
        data = manifest.to_json()
        data.pop("files")
        data["heads"] = export_heads(heads_dirs, embed, lm_head, staging.path, default)
        return staging.commit(data)
