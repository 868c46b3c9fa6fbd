"""Heads into bundles: ONNX export and validation of head graphs, the manifest's ``heads`` section, ``add_heads``.

``export_heads`` turns trained heads folders (``heads_folder.py``) into ONNX graphs inside a
bundle (``heads/<method>.onnx``, or ``target/<method>_head.onnx``: below), each validated against
its torch module in ONNX Runtime; ``add_heads`` writes a copy of an existing bundle with heads,
atomically. Both the graph and its manifest entry follow the method's recipe (``head_recipes.py``):
EAGLE's and EAGLE-3's step graphs are built op by op with 8-bit linear layers (``head_builder.py``),
Medusa's is traced from its torch wrapper.

A head graph that embeds tokens (EAGLE, EAGLE-3) needs the target's [V, H] embedding. Where the target
graph keeps it as a float table, the head graph reads that table's bytes in the target's data
file instead of shipping a copy: such a head graph lives beside the target graph
(``target/<method>_head.onnx``), because ONNX Runtime reads external data only from the
graph's own folder. Otherwise (quantized tables) the head ships its own fp16 copy, once.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdec_edge.bundle.hashes import check_sources
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.bundle.write import StagingDir
from specdec_edge.errors import ExportError
from specdec_edge.exactness import trees_exact
from specdec_edge.export.head_builder import QUANTIZED_TOLERANCE, WEIGHT_BITS, WEIGHT_BLOCK
from specdec_edge.export.head_onnx import TOP_K
from specdec_edge.export.head_recipes import HeadRecipe, recipe_for
from specdec_edge.export.heads_folder import load_heads

TOLERANCE = 1e-3  # max |onnx - torch| of a traced (fp32) graph's outputs, relative to their scale


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
    """Worst relative error per output (and top-1 id agreement, top-k overlap) of the ONNX file vs ``graph`` over
    ``examples``."""
    from specdec_edge.runtime.sessions import create_session
    from specdec_edge.runtime.threads import DEFAULT_THREADS, cpu_session_options

    sess = create_session(path, cpu_session_options(DEFAULT_THREADS), "cpu")
    report: dict = {}
    for example in examples:  # the traced shapes and other ones (dynamic axes)
        with torch.no_grad():
            want = [t.numpy() for t in graph(*example)]
        got = sess.run(None, {n: t.numpy() for n, t in zip(recipe.inputs, example)})
        for name, g, w in zip(recipe.outputs, got, want):
            if name == "topk_ids":  # top-1 agreement; the mean share of the top-k ids both return
                agree = float(np.mean(g[..., 0] == w[..., 0]))
                report["topk_ids_agreement"] = min(report.get("topk_ids_agreement", 1.0), agree)
                flat_g, flat_w = g.reshape(-1, g.shape[-1]), w.reshape(-1, w.shape[-1])
                overlap = float(np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(flat_g, flat_w)]))
                report["topk_overlap"] = min(report.get("topk_overlap", 1.0), overlap)
                continue
            err = float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-6))
            report[f"{name}_max_rel_err"] = max(report.get(f"{name}_max_rel_err", 0.0), err)
    return report


def export_head_graph(head: nn.Module, path: Path, table: dict | None = None) -> dict:
    """Write ``head``'s graph at ``path`` -- built op by op where its recipe has a builder (``head_builder.py``),
    else traced from its torch wrapper -- validate it against that wrapper in ONNX Runtime; return the report.

    A built graph is checked twice: with fp32 layers (its structure, at ``TOLERANCE``; a scratch file beside
    ``path``, removed), then as written, with 8-bit layers (at ``QUANTIZED_TOLERANCE``; ``max_rel_err``).
    ``table``: the target graph's float embedding table (``float_table``), which a built graph reads instead of
    holding a copy; ``path`` must then be beside the target graph."""
    from specdec_edge.export.graph import save

    recipe = recipe_for(head.cfg.method)
    graph, examples = recipe.graph(head), recipe.examples(head.cfg)
    if not recipe.build:
        _write_graph(graph, recipe, examples[0], path)
        return _checked(_compare(graph, recipe, examples, path), TOLERANCE, recipe.name)
    scratch = path.with_name(path.stem + ".fp32.onnx")
    try:
        save(recipe.build(head, bits=None, table=table), scratch)
        fp32 = _checked(_compare(graph, recipe, examples, scratch), TOLERANCE, f"{recipe.name} (fp32 layers)")
    finally:
        for file in (scratch, scratch.with_name(scratch.name + ".data")):
            file.unlink(missing_ok=True)
    save(recipe.build(head, table=table), path)
    report = _checked(_compare(graph, recipe, examples, path), QUANTIZED_TOLERANCE, recipe.name)
    report["weights"] = f"{WEIGHT_BITS}-bit blocks of {WEIGHT_BLOCK}"
    report["fp32_layers_max_rel_err"] = fp32["max_rel_err"]
    return report


def _checked(report: dict, tolerance: float, name: str) -> dict:
    """``report`` with its worst relative error and ``tolerance``; an ExportError if the error is above it."""
    worst = max(v for k, v in report.items() if k.endswith("err"))
    report["max_rel_err"], report["tolerance"] = worst, tolerance
    if not np.isfinite(worst) or worst > tolerance:
        raise ExportError(
            f"the {name} head graph differs from PyTorch by {worst:.3g} > {tolerance}; no bundle was written."
        )
    return report


def export_heads(
    heads_dirs,
    embed: np.ndarray,
    lm_head: np.ndarray,
    root: Path,
    chains: bool = False,
    target_graph: str | None = None,
) -> dict:
    """Build and validate a graph per heads folder under ``root/heads``; the manifest's ``heads`` section.

    ``embed`` and ``lm_head``: the target's [V, H] weights.
    ``chains``: record one-branch tree settings (the target verifies only chains bit for bit).
    ``target_graph``: the target graph's path in the bundle; head graphs that embed tokens (the built ones) read its
    float embedding table, if it has one, instead of a copy of their own, from beside it.
    """
    section = {}
    (root / "heads").mkdir(exist_ok=True)
    table = float_table(root / target_graph) if target_graph else None
    for folder in heads_dirs:
        head = load_heads(Path(folder), embed, lm_head, table["dtype"] if table else np.float16)
        cfg = head.cfg
        if cfg.method in section:
            raise ExportError(f"two {cfg.method} heads folders were given; pass one per method.")
        shared = table if table and recipe_for(cfg.method).build else None
        path = root / "heads" / f"{cfg.method}.onnx"
        if shared:
            path = root / Path(target_graph).parent / f"{cfg.method}_head.onnx"
        report = export_head_graph(head, path, shared)
        config = {k: v for k, v in asdict(cfg).items() if k not in ("method", "training")}
        section[cfg.method] = {
            "graph": path.relative_to(root).as_posix(),
            "top_k": TOP_K,
            "config": config,
            "tree": recipe_for(cfg.method).chain if chains else recipe_for(cfg.method).tree,
            "training": cfg.training,
            "validation": report,
        }
    if not any((root / "heads").iterdir()):  # every head graph reads the target's table
        (root / "heads").rmdir()
    return section


def float_table(graph_path: Path) -> dict | None:
    """Where a target graph keeps its float embedding table [V, H]: its data file (beside the graph), offset,
    length, ONNX and numpy dtype, shape; None when the table is quantized or held inside the .onnx file."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(graph_path), load_external_data=False)
    for init in model.graph.initializer:
        if init.name == "model.embed_tokens.weight" and uses_external_data(init):
            info = {e.key: e.value for e in init.external_data}
            kinds = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16}
            if init.data_type not in kinds:
                return None
            return {
                "location": info["location"],
                "offset": int(info.get("offset", 0)),
                "length": int(info["length"]),
                "data_type": init.data_type,
                "dtype": kinds[init.data_type],
                "dims": list(init.dims),
            }
    return None


def target_weights(bundle: Path, graph=None) -> tuple[np.ndarray, np.ndarray]:
    """The target's embedding [V, H] and LM head [V, H] read from a bundle's fp32/fp16 graph (``graph``: its
    GraphSpec, where ``bundle`` is a folder without a manifest yet)."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    graph = graph or read_manifest(bundle).target.graph
    path = Path(bundle) / graph.path
    if graph.dtype not in ("fp32", "fp16"):
        return quantized_target_weights(path, graph)
    model = onnx.load(str(path), load_external_data=False)  # read only the two tensors needed
    found = {i.name: i for i in model.graph.initializer if i.name in ("model.embed_tokens.weight", "lm_head.weight.T")}
    for tensor in found.values():
        if uses_external_data(tensor):
            load_external_data_for_tensor(tensor, str(path.parent))
    embed = numpy_helper.to_array(found["model.embed_tokens.weight"]).astype(np.float32)  # [V, H]
    if "lm_head.weight.T" not in found:  # tied: the graph's LM head reads the embedding
        return embed, embed
    head = numpy_helper.to_array(found["lm_head.weight.T"]).astype(np.float32).T  # [V, H]
    return embed, np.ascontiguousarray(head)


def quantized_target_weights(path: Path, graph) -> tuple[np.ndarray, np.ndarray]:
    """The embedding [V, H] and LM head [V, H] of a quantized target graph, as the graph computes them: its
    embedding part run over every token id, its LM head over the identity (ONNX Runtime on parts of the graph)."""
    import onnx
    import onnxruntime as ort

    if graph.flavour != "ort":
        raise ExportError(f"heads on a quantized {graph.flavour!r} bundle: export the target with --heads instead.")
    model = onnx.load(str(path))
    nodes = list(model.graph.node)
    producer = {out: n for n in nodes for out in n.output}
    # The residual stream entering layer 0 (the scaled embedding) is the skip input of the graph's first
    # add-and-norm (layer 0's residual after attention).
    entering = next(n.input[1] for n in nodes if n.op_type == "SkipSimplifiedLayerNormalization")
    scale = producer.get(entering)
    constants = {i.name for i in model.graph.initializer} | {n.output[0] for n in nodes if n.op_type == "Constant"}
    scaled = scale is not None and scale.op_type == "Mul" and scale.input[1] in constants
    rows = scale.input[0] if scaled else entering  # the table's rows, before Gemma's sqrt(H) scale
    # The LM head reads the final norm's rows kept by the logits_to_keep Slice.
    kept = next(n.output[0] for n in nodes if n.op_type == "Slice" and producer.get(n.input[1]) is not None
                and producer[n.input[1]].op_type == "Neg")  # fmt: skip
    from specdec_edge.runtime.threads import app_session_options

    options = app_session_options()
    options.log_severity_level = 3

    def run(inputs, output, feed):
        session = ort.InferenceSession(
            _part(model, inputs, output).SerializeToString(), options, ["CPUExecutionProvider"]
        )
        return session.run(None, feed)[0]

    ids = np.arange(graph.vocab_size, dtype=np.int64)
    embed = np.concatenate([run(["input_ids"], rows, {"input_ids": ids[None, i : i + 4096]})[0]
                            for i in range(0, len(ids), 4096)])  # fmt: skip
    eye = np.eye(graph.hidden_size, dtype=np.float32)[None]
    head = run([kept], "logits", {kept: eye})[0].T  # logits of the unit vectors: the head's columns
    return embed.astype(np.float32), np.ascontiguousarray(head, dtype=np.float32)


def _part(model, inputs: list[str], output: str):
    """The part of ``model`` that computes ``output`` from ``inputs`` (and its initializers), as a model."""
    from onnx import TensorProto, helper

    need, keep = {output}, []
    for node in reversed(model.graph.node):
        if any(o in need for o in node.output):
            keep.append(node)
            need |= {i for i in node.input if i and i not in inputs}
    initializers = [i for i in model.graph.initializer if i.name in need]
    declared = {v.name: v for v in model.graph.input}
    graph = helper.make_graph(
        keep[::-1],
        "part",
        [declared.get(name) or helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in inputs],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
        initializers,
    )
    part = helper.make_model(graph, opset_imports=model.opset_import)
    part.ir_version = model.ir_version
    return part


def target_final_norm(bundle: Path) -> np.ndarray | None:
    """The target's final norm weight [H] (as the graph applies it) from a bundle's fp32/fp16 graph, if found."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    path = Path(bundle) / read_manifest(bundle).target.graph.path
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        if tensor.name == "model.norm.weight":
            if uses_external_data(tensor):
                load_external_data_for_tensor(tensor, str(path.parent))
            return numpy_helper.to_array(tensor).astype(np.float32)
    return None


def add_heads(bundle: str | Path, heads_dirs, out: str | Path, force: bool = False) -> Path:
    """Write a copy of ``bundle`` with head graphs at ``out`` (staged, then renamed into place); every copied file
    is hashed against the source's manifest first, so a damaged source is refused, never re-recorded."""
    bundle, out = Path(bundle), Path(out)
    manifest = read_manifest(bundle)
    if not manifest.target.graph.has_hidden_states:
        raise ExportError(
            f"bundle {bundle} has no hidden_states output; heads read it. Re-export with --hidden-states."
        )
    from specdec_edge.export.heads_folder import heads_feature_layers

    wanted = tuple(heads_feature_layers(heads_dirs))
    if wanted and wanted != tuple(manifest.target.graph.feature_layers):
        raise ExportError(
            f"the EAGLE-3 heads read target layers {list(wanted)} and bundle {bundle} outputs "
            f"{list(manifest.target.graph.feature_layers) or 'none'}; export the model with these heads instead "
            "(`export --heads`)."
        )
    if out.resolve() == bundle.resolve():
        raise ExportError("--out must differ from the source bundle; the new bundle is written beside it.")
    old_heads = {h.graph for h in manifest.heads.values()}
    old_heads |= {g + ".data" for g in old_heads}
    with StagingDir(out, force) as staging:
        copied = [rel for rel in manifest.files if not rel.startswith("heads/") and rel not in old_heads]
        for rel in copied:
            dest = staging.path / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(bundle / rel, dest)
        # every copy hashed against the source's manifest: a damaged source must not pass as a fresh bundle
        check_sources(staging.path, manifest, copied, source=bundle)
        graph = manifest.target.graph
        embed, lm_head = target_weights(staging.path, graph)  # from the checked copy
        data = manifest.to_json()
        data.pop("files")
        chains = not trees_exact(graph.verdict, graph.dtype)  # as `export --heads` records them
        data["heads"] = export_heads(heads_dirs, embed, lm_head, staging.path, chains, graph.path)
        return staging.commit(data)
