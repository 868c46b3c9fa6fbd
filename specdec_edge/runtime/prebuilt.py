"""Prebuilt TensorRT and TensorRT-RTX engines of a bundle: lookup, sidecar checks, the CUDA import.

``specdec-edge build-engines BUNDLE`` (``export/build_engines.py``) writes engines into
``trt/<gpu>_<version>/`` (TensorRT-RTX: ``trt/<gpu or targets>_rtx-<version>/``) and lists them in
the manifest under ``engines``::

    {"kind": "tensorrt" | "ort-epcontext" | "tensorrt-rtx", "role": "target",
     "file": "trt/.../target.plan", "sidecar": "trt/.../target.plan.json"}

Each sidecar records the library and version that built the engine (``library``,
``library_version``), the GPU and compute capability (TensorRT-RTX: the list it was built for),
precision, the optimization profile and the source graph's sha256. A serialized engine runs only
under the library and version that built it, on a compute capability it was built for (or, with a
TensorRT hardware-compatibility level, on Ampere and newer); a mismatch is an error that says so
and says to rebuild.

The ``trt`` and ``trt-rtx`` backends (``tensorrt_engine.py``) also need ``cuda-python``
(``from cuda.bindings import runtime``, or ``from cuda import cudart`` in older releases, as the
TensorRT samples use). Libraries are imported when an engine is looked up or opened, never at module import.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.bundle.schema import GraphSpec
from specdec_edge.errors import BundleError, SpecdecError
from specdec_edge.runtime.trt_libraries import (
    KIND_BACKEND,
    KIND_LIBRARY,
    RTX_COMPUTE_CAPABILITIES,
    TENSORRT,
    TrtLibrary,
    import_library,
)
from specdec_edge.user_cache import cache_dir

REBUILD = "rebuild with `specdec-edge build-engines BUNDLE` on this device"
SIDECAR_FORMAT = 2  # what `build-engines` writes; a sidecar of any other format is refused (rebuild)


def import_cudart():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            raise SpecdecError(
                "providers 'trt' and 'trt-rtx' need cuda-python for device memory: pip install cuda-python "
                "(the major version matching your CUDA), or use provider 'cuda'."
            ) from None
    return cudart


def gpu_info() -> dict:
    """``{"name", "compute_capability"}`` of GPU 0 (choose it with CUDA_VISIBLE_DEVICES), from cuda-python or
    nvidia-smi."""
    try:
        cudart = import_cudart()
        props = cuda_check(cudart, cudart.cudaGetDeviceProperties(0))
        name = props.name.decode(errors="replace").rstrip("\0") if isinstance(props.name, bytes) else str(props.name)
        return {"name": name, "compute_capability": f"{props.major}.{props.minor}"}
    except SpecdecError:
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        out = None
    if out is None or out.returncode != 0 or "," not in out.stdout:
        raise SpecdecError(
            "no NVIDIA GPU found (neither cuda-python nor nvidia-smi could query one); "
            "TensorRT engines need one. Use provider 'cpu'."
        )
    name, cc = (part.strip() for part in out.stdout.strip().splitlines()[0].rsplit(",", 1))
    return {"name": name, "compute_capability": cc}


def engine_dir_name(gpu_name: str, version: str, library: TrtLibrary = TENSORRT) -> str:
    """``trt/<gpu>_<version>`` folder, e.g. ``nvidia-h200_10.13.3`` or ``nvidia-geforce-rtx-4090_rtx-1.7.1.116``."""
    slug = re.sub(r"[^a-z0-9.]+", "-", gpu_name.lower()).strip("-")
    return f"{slug}_{'' if library is TENSORRT else 'rtx-'}{version}"


def check_sidecar(
    sidecar: dict,
    *,
    version: str,
    compute_capability: str,
    source_sha256: str | None,
    library: TrtLibrary = TENSORRT,
) -> None:
    """Raise BundleError unless an engine with ``sidecar`` can run here, under ``library`` ``version``."""
    name = sidecar.get("file", "engine")
    if sidecar.get("format") != SIDECAR_FORMAT:
        raise BundleError(f"{name}: unknown engine sidecar format {sidecar.get('format')!r}; {REBUILD}.")
    built_lib, built_version = sidecar.get("library", "?"), sidecar.get("library_version")
    titles = {"tensorrt": "TensorRT", "tensorrt-rtx": "TensorRT-RTX"}
    built_title = titles.get(built_lib, built_lib)
    if built_lib != library.name:
        raise BundleError(
            f"{name} is a {built_title} engine and {library.title} cannot load it: use the provider of its library "
            f"(TensorRT: 'trt', TensorRT-RTX: 'trt-rtx'), or {REBUILD}."
        )
    if built_version != version:
        raise BundleError(
            f"{name} was built with {built_title} {built_version}, this machine has {library.title} {version}; "
            f"engines only load in the version that built them: {REBUILD}."
        )
    built = sidecar.get("compute_capability")
    level = sidecar.get("hardware_compatibility", "none")
    if library.name == "tensorrt-rtx":
        targets = sidecar.get("compute_capabilities") or [built]
        if compute_capability not in targets:
            hint = f"{REBUILD} (or with --compute-capability {compute_capability} anywhere)"
            if compute_capability not in RTX_COMPUTE_CAPABILITIES:
                hint = (
                    f"TensorRT-RTX builds for {', '.join(RTX_COMPUTE_CAPABILITIES)} only (RTX GPUs); on this GPU use "
                    "provider 'cuda' (or 'trt' with full TensorRT)"
                )
            raise BundleError(
                f"{name} was built for compute capability {', '.join(targets)}; this GPU has {compute_capability}: "
                f"{hint}."
            )
    elif level == "ampere_plus":
        if tuple(int(x) for x in compute_capability.split(".")) < (8, 0):
            raise BundleError(
                f"{name} is hardware-compatible with Ampere and newer (compute capability >= 8.0); "
                f"this GPU has {compute_capability}: {REBUILD}."
            )
    elif built != compute_capability:
        raise BundleError(
            f"{name} was built for compute capability {built} ({sidecar.get('gpu', '?')}); this GPU "
            f"has {compute_capability}: {REBUILD} (or build with --hardware-compatible on Ampere+)."
        )
    if source_sha256 is not None and sidecar.get("source_sha256") != source_sha256:
        raise BundleError(f"{name} was built from another version of its ONNX graph (sha256 differs); {REBUILD}.")


def source_sha256(root: Path, graph: GraphSpec) -> str | None:
    """The sha256 the bundle's manifest records for ``graph``'s ONNX file."""
    return read_manifest(root).files.get(graph.path, {}).get("sha256")


def find_prebuilt(
    root: Path, role: str, kind: str, graph: GraphSpec | None = None, *, required: bool = False
) -> dict | None:
    """The bundle's engine of ``kind`` for ``role`` that can run on this machine.

    None when the bundle has none (or this machine cannot be queried) and not ``required``;
    with ``required``, the first incompatibility is raised as an error saying to rebuild.
    """
    root = Path(root)
    candidates = [e for e in read_manifest(root).engines if e.get("role") == role and e.get("kind") == kind]
    if not candidates:
        if required:
            backend = KIND_BACKEND[kind]
            raise BundleError(
                f"bundle {root} has no {kind} engine for the {role} model; build one with "
                f"`specdec-edge build-engines {root} --backend {backend}` on this device."
            )
        return None
    library = KIND_LIBRARY[kind]
    try:
        here = {
            "library": library,
            "version": import_library(library).__version__,
            "compute_capability": gpu_info()["compute_capability"],
        }
    except SpecdecError:
        if required:
            raise
        return None
    error = None
    for entry in candidates:
        sidecar = dict(json.loads((root / entry["sidecar"]).read_text()), file=entry["file"])
        try:
            check_sidecar(sidecar, **here, source_sha256=source_sha256(root, graph) if graph else None)
        except BundleError as e:
            error = error or e
            continue
        return {**entry, "sidecar_data": sidecar}
    if required:
        raise error
    return None


def engine_cache_dir(root: Path, graph: GraphSpec) -> Path:
    """Per-user TensorRT EP engine cache for one graph (the bundle itself may be read-only)."""
    base = cache_dir() / "trt-ep"
    return base / (source_sha256(root, graph) or re.sub(r"\W+", "-", str(Path(root).resolve())))[:16]


def cuda_check(cudart, result):
    """Unwrap a cuda-python call's ``(error, *values)``; raise on a CUDA error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        raise SpecdecError(f"CUDA call failed: {cudart.cudaGetErrorName(err)[1]!r}; check the GPU and driver.")
    return values[0] if len(values) == 1 else values
