"""`specdec-edge build-engines`: build TensorRT / TensorRT-RTX engines for a bundle.

Three kinds (backends), written to ``BUNDLE/trt/<gpu>_<version>/`` and listed in the manifest's
``engines`` (see ``runtime/prebuilt.py``), each with a JSON sidecar:

* ``trt``: a serialized TensorRT engine built with the TensorRT Python API from the portable
  graph: a strongly typed network (the graph's own fp16/fp32 types decide precision; no
  deprecated precision flags), one optimization profile (S from 1 to the largest pass, bias
  width up to the cache capacity; ``logits_to_keep`` as a shape value), optionally
  hardware-compatible with Ampere and newer. Run by provider ``trt``. Built on the GPU that runs it.
* ``tensorrt``: an ONNX Runtime EPContext model (``ep.context_enable``, embed mode 1: the
  engine inside the .onnx) made by the TensorRT EP with the options of
  ``runtime.trt_profiles.tensorrt_ep_options``. Run by provider ``tensorrt``.
* ``trt-rtx``: the same network built by TensorRT-RTX (``runtime/trt_libraries.py``) into
  ``trt/<gpu>_rtx-<version>/``, for this machine's GPU or, ahead of time and without a GPU, for the
  compute capabilities given (``--compute-capability 8.9``); kernels compile when it first runs.
  Run by provider ``trt-rtx``.

Without ``--backend``, the libraries installed decide: TensorRT's two kinds, else TensorRT-RTX's.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
from pathlib import Path

from specdec_edge.atomic import write_atomic
from specdec_edge.bundle.hashes import check_sources, sha256_file
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.bundle.schema import MANIFEST, GraphSpec
from specdec_edge.bundle.write import check_writable, disk_errors
from specdec_edge.errors import ExportError, SpecdecError
from specdec_edge.runtime.base import MAX_VERIFY
from specdec_edge.runtime.prebuilt import SIDECAR_FORMAT, engine_dir_name, gpu_info
from specdec_edge.runtime.sessions import create_session, session_options
from specdec_edge.runtime.trt_libraries import (
    ENGINE_KINDS,
    TENSORRT,
    TENSORRT_RTX,
    TrtLibrary,
    import_library,
    installed,
    set_rtx_targets,
)
from specdec_edge.runtime.trt_profiles import shape_value_ranges, tensorrt_ep_options, tensorrt_profiles

KINDS = ENGINE_KINDS  # backend -> (engine kind in the manifest, file suffix, library)


def default_backends() -> tuple:
    """TensorRT's two kinds where ``tensorrt`` is installed, else TensorRT-RTX's where ``tensorrt_rtx`` is."""
    if not installed(TENSORRT) and installed(TENSORRT_RTX):
        return ("trt-rtx",)
    return ("trt", "tensorrt")


def make_sidecar(
    graph: GraphSpec,
    source_sha256: str,
    *,
    library: TrtLibrary = TENSORRT,
    version: str,
    gpu: dict | None,
    max_verify: int,
    hardware_compatible: bool,
    compute_capabilities: list[str] | None = None,
) -> dict:
    """The build record an engine is checked against when it is loaded (``prebuilt.check_sidecar``)."""
    built_cc = gpu["compute_capability"] if gpu else None
    return {
        "format": SIDECAR_FORMAT,
        "library": library.name,
        "library_version": version,
        "gpu": gpu["name"] if gpu else None,
        "compute_capability": built_cc,
        # TensorRT-RTX: the GPUs the engine runs on (built ahead of time for them, or for this one)
        "compute_capabilities": list(compute_capabilities or [built_cc]),
        "hardware_compatibility": "ampere_plus" if hardware_compatible else "none",
        "precision": "fp16" if graph.dtype == "fp16" else "fp32",
        "profile": {k: [list(s) for s in v] for k, v in tensorrt_profiles(graph, max_verify).items()},
        "shape_values": {k: [list(s) for s in v] for k, v in shape_value_ranges(graph, max_verify).items()},
        "source_graph": graph.path,
        "source_sha256": source_sha256,
        "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def builder_config(
    trt,
    builder,
    network,
    graph: GraphSpec,
    *,
    library: TrtLibrary,
    max_verify: int,
    hardware_compatible: bool = False,
    compute_capabilities: list[str] | None = None,
):
    """The builder config of one engine: one optimization profile over every pass the runtime sends; TensorRT-RTX:
    its build targets. No precision flags: the network is strongly typed (TensorRT-RTX has no such flags)."""
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    shapes, values = tensorrt_profiles(graph, max_verify), shape_value_ranges(graph, max_verify)
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        if tensor.is_shape_tensor:
            profile.set_shape_input(tensor.name, *values[tensor.name])
        elif tensor.name in shapes:
            profile.set_shape(tensor.name, *shapes[tensor.name])
        else:
            fixed = tuple(1 if d < 0 else d for d in tensor.shape)
            profile.set_shape(tensor.name, fixed, fixed, fixed)
    config.add_optimization_profile(profile)
    if library is TENSORRT_RTX:
        set_rtx_targets(trt, config, compute_capabilities)
    elif hardware_compatible:
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    return config


def build_plan(
    onnx_path: Path,
    graph: GraphSpec,
    out: Path,
    *,
    max_verify: int,
    hardware_compatible: bool = False,
    library: TrtLibrary = TENSORRT,
    compute_capabilities: list[str] | None = None,
) -> None:
    """Serialize a strongly typed TensorRT (or TensorRT-RTX) engine for ``graph`` to ``out``."""
    trt = import_library(library)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ExportError(f"{library.title} could not parse {onnx_path}: {errors}")
    config = builder_config(
        trt,
        builder,
        network,
        graph,
        library=library,
        max_verify=max_verify,
        hardware_compatible=hardware_compatible,
        compute_capabilities=compute_capabilities,
    )
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ExportError(f"{library.title} failed to build an engine from {onnx_path} (see its log above).")
    out.write_bytes(bytes(plan))


def build_ep_context(onnx_path: Path, graph: GraphSpec, out: Path, *, max_verify: int) -> None:
    """Let the ONNX Runtime TensorRT EP build its engine and dump it as an EPContext model at ``out``."""
    opts = session_options()
    opts.add_session_config_entry("ep.context_enable", "1")
    opts.add_session_config_entry("ep.context_file_path", str(out))
    opts.add_session_config_entry("ep.context_embed_mode", "1")
    with tempfile.TemporaryDirectory() as cache:  # embed mode: the engine lives in the .onnx, not in the cache
        create_session(onnx_path, opts, "tensorrt", tensorrt_ep_options(graph, cache, max_verify=max_verify))
    if not out.is_file():
        raise ExportError(
            f"ONNX Runtime did not write the EPContext model {out}; "
            "EPContext needs onnxruntime-gpu >= 1.18 with the TensorRT EP."
        )


def register_engines(root: Path, entries: list[dict]) -> None:
    """Add engine files to the manifest (``files`` and ``engines``), replacing same role/kind/folder entries."""
    root = Path(root)
    path = root / MANIFEST
    data = json.loads(path.read_text())
    new = {(e["role"], e["kind"], e["file"]) for e in entries}
    data["engines"] = [e for e in data.get("engines", []) if (e["role"], e["kind"], e["file"]) not in new] + entries
    for entry in entries:
        for rel in (entry["file"], entry["sidecar"]):
            data["files"][rel] = {"sha256": sha256_file(root / rel), "size": (root / rel).stat().st_size}
    write_atomic(path, json.dumps(data, indent=2) + "\n")
    read_manifest(root)


def _check_backends(backends: tuple, hardware_compatible: bool, compute_capabilities: list):
    """The one library (TensorRT or TensorRT-RTX) ``backends`` are built with, or an error naming what to change."""
    unknown = set(backends) - set(KINDS)
    if unknown or not backends:
        raise ExportError(f"unknown backend(s) {sorted(unknown)}; choose from {', '.join(KINDS)}.")
    libraries = {KINDS[b][2] for b in backends}
    if len(libraries) > 1:
        raise ExportError("build TensorRT (trt, tensorrt) and TensorRT-RTX (trt-rtx) engines in separate calls.")
    library = libraries.pop()
    if library is TENSORRT_RTX and hardware_compatible:
        raise ExportError(
            "--hardware-compatible is TensorRT's; TensorRT-RTX engines run on the compute capabilities they are "
            "built for: list them with --compute-capability."
        )
    if library is TENSORRT and compute_capabilities:
        raise ExportError("--compute-capability is for --backend trt-rtx; TensorRT builds for the GPU it runs on.")
    return library


def build_engines(
    bundle: str | Path,
    *,
    backends: tuple | None = None,
    max_verify: int = MAX_VERIFY,
    hardware_compatible: bool = False,
    compute_capabilities: list[str] | tuple | None = None,
    echo=print,
) -> Path:
    """Build engines of each backend for every decoder graph of ``bundle``; returns the engine folder.

    ``backends``: from ``KINDS`` (default: ``default_backends()``), of one library per call.
    ``compute_capabilities`` (``trt-rtx`` only): build ahead of time for these GPUs, e.g. ["8.9", "12.0"]; no GPU
    is needed then. Default: this machine's GPU.
    """
    root = Path(bundle)
    manifest = read_manifest(root)
    backends = tuple(backends or default_backends())
    compute_capabilities = list(compute_capabilities or [])
    library = _check_backends(backends, hardware_compatible, compute_capabilities)
    models = [m for m in (manifest.target, manifest.draft) if m is not None]
    for m in models:
        if m.graph.flavour != "portable":
            raise ExportError(
                f"the {m.role} graph is the {m.graph.flavour!r} flavour; TensorRT needs standard ops: "
                "re-export with --flavour portable (and --dtype fp16)."
            )
    # The engines go into the bundle: a read-only or unwritable one is refused before the library loads.
    check_writable(root, f"bundle {root}", "copy the bundle to a writable folder and build there")
    # and are built from graphs hashed now: an engine of damaged bytes would be recorded as the bundle's own
    check_sources(root, manifest, [rel for rel in manifest.files if rel.split("/")[0] in {m.role for m in models}])
    version = import_library(library).__version__
    try:
        gpu = gpu_info()
    except SpecdecError:
        if not compute_capabilities:  # only an ahead-of-time TensorRT-RTX build needs no GPU
            raise
        gpu = None
    where = gpu["name"] if gpu else "cc-" + "-".join(compute_capabilities)
    folder = Path("trt") / engine_dir_name(where, version, library)
    with disk_errors(root / folder):
        (root / folder).mkdir(parents=True, exist_ok=True)
        # Build into a scratch folder; only finished engines move into the bundle.
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root / "trt"))
    entries = []
    try:
        for m in models:
            sidecar = make_sidecar(
                m.graph,
                manifest.files[m.graph.path]["sha256"],
                library=library,
                version=version,
                gpu=gpu,
                max_verify=max_verify,
                hardware_compatible=hardware_compatible,
                compute_capabilities=compute_capabilities,
            )
            for backend in backends:
                kind, suffix, _ = KINDS[backend]
                name = f"{m.role}{suffix}"
                echo(f"  [{m.role}] building {kind} engine {folder / name} ...")
                if backend == "tensorrt":
                    build_ep_context(root / m.graph.path, m.graph, staging / name, max_verify=max_verify)
                    record = {**sidecar, "hardware_compatibility": "none"}  # the EP builds for this GPU only
                else:
                    build_plan(
                        root / m.graph.path,
                        m.graph,
                        staging / name,
                        max_verify=max_verify,
                        hardware_compatible=hardware_compatible,
                        library=library,
                        compute_capabilities=compute_capabilities,
                    )
                    record = sidecar
                (staging / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
                entries.append(
                    {
                        "kind": kind,
                        "role": m.role,
                        "file": (folder / name).as_posix(),
                        "sidecar": (folder / f"{name}.json").as_posix(),
                    }
                )
        for item in staging.iterdir():
            os.replace(item, root / folder / item.name)
    except OSError as e:  # a disk that fills up while the engines are built
        with disk_errors(root / folder):
            raise e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    register_engines(root, entries)
    return root / folder
