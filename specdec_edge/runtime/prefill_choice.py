"""Whether OpenVINO's prefill pays on this device: measured once per device and bundle, then cached.

``--prefill auto`` (the default) may attach OpenVINO to prefill the target's cache (``runtime/ov_prefill.py``).
Whether that is faster depends on the CPU: on an AVX-512 one it ran 256-row passes of the default gguf bundle
1.3-1.7x faster than ONNX Runtime, on an AVX2-only one 0.84x as fast (docs/lab/prefill-and-passes.md). So
``choose_prefill`` times both runtimes on the same rows (alternately, the least of a few passes each, after both
ran once and OpenVINO's K/V were checked against ONNX Runtime's) and keeps OpenVINO only where it is at least
``GAIN`` times faster. The choice is cached per bundle and device (``<cache>/prefill/``, written atomically), so a
device always prefills the same way: the output of a call depends on which runtime prefilled it (two roundings of
the same model), and it must not change from one load to the next. ``--prefill openvino`` / ``onnxruntime`` pin it.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np

from specdec_edge.atomic import write_atomic
from specdec_edge.bundle.hashes import manifest_digest as bundle_digest
from specdec_edge.errors import SpecdecError
from specdec_edge.progress import Progress, report
from specdec_edge.runtime.device import device_key
from specdec_edge.user_cache import cache_dir

CHOICE_FORMAT = 1  # bumped when what is measured changes: older records are measured again
ROWS = 256  # a prefill chunk of ONNX Runtime's (PREFILL_CHUNK)
ROUNDS = 3  # timed passes per runtime, alternating; the least of each is compared
GAIN = 1.1  # OpenVINO prefills only where its pass takes at most 1/GAIN of ONNX Runtime's


def choice_path(digest: str, graph_path: str, device: dict) -> Path:
    key = json.dumps([CHOICE_FORMAT, digest, graph_path, device_key(device)])
    return cache_dir() / "prefill" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")


def measure_prefill(engine, rows: int = ROWS, rounds: int = ROUNDS) -> dict:
    """Seconds of one prefill pass of ``rows`` random tokens by ONNX Runtime (``engine.run``) and by its attached
    prefiller, from an empty cache, and OpenVINO's speedup. The engine's cache is left empty (``reset``). A prefiller
    that cannot compile the graph or disagrees with ONNX Runtime raises ``SpecdecError`` (``OrtEngine``'s check)."""
    rows = max(1, min(rows, engine.capacity // 2))
    ids = np.random.default_rng(0).integers(0, engine.vocab_size, size=rows)
    engine.reset()
    try:
        engine.check_prefiller(ids, 1)  # both run once (warm-up), and the K/V are checked
        times: dict[str, list[float]] = {"onnxruntime": [], "openvino": []}
        for _ in range(rounds):
            start = time.perf_counter()
            engine.run(ids, logits_to_keep=1)
            times["onnxruntime"].append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.prefiller.run(engine.cache, 0, engine.step_inputs(ids, None, None, 1))
            times["openvino"].append(time.perf_counter() - start)
    finally:
        engine.reset()
    best = {name: min(t) for name, t in times.items()}
    return {
        "rows": rows,
        "onnxruntime_s": round(best["onnxruntime"], 6),
        "openvino_s": round(best["openvino"], 6),
        "speedup": round(best["onnxruntime"] / max(best["openvino"], 1e-9), 4),
    }


def load_choice(path: Path) -> dict | None:
    """The cached record at ``path``, or None where there is none or it is not one this version wrote."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != CHOICE_FORMAT:
        return None
    return data if data.get("runtime") in ("onnxruntime", "openvino") else None


def decide(measured: dict) -> str:
    return "openvino" if measured["speedup"] >= GAIN else "onnxruntime"


def choose_prefill(root, graph_path: str, engine, device: dict, progress: Progress | None = None):
    """The prefiller ``engine`` should keep under ``--prefill auto``: its attached one where the cached or a new
    measurement on ``device`` says OpenVINO prefills at least ``GAIN`` times faster, else None (ONNX Runtime)."""
    digest = bundle_digest(root)
    path = choice_path(digest, graph_path, device)
    record = load_choice(path)
    if record is None:
        report(
            progress,
            f"specdec-edge: timing OpenVINO's prefill against ONNX Runtime's on {device.get('name')}; once per "
            "device, a few seconds",
        )
        try:
            record = {**measure_prefill(engine), "runtime": None}
            record["runtime"] = decide(record)
        except SpecdecError as e:  # cannot compile, or computes another function: ONNX Runtime prefills
            record = {"runtime": "onnxruntime", "error": str(e)}
        record = {"format": CHOICE_FORMAT, "bundle": digest, "graph": graph_path, "device": device, **record}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(record, indent=1))
            where = f"; cached in {path}"
        except OSError:
            where = " (the cache is not writable: measured again next time)"
        why = f"OpenVINO ran at {record['speedup']}x ONNX Runtime's speed" if "speedup" in record else record["error"]
        report(progress, f"specdec-edge: {record['runtime']} prefills here ({why}){where}")
    return engine.prefiller if record["runtime"] == "openvino" else None


def cached_choices(root) -> list[dict]:
    """Every cached choice for the bundle at ``root`` (any device), as stored: for ``info``."""
    digest = bundle_digest(root)
    found = []
    for path in sorted((cache_dir() / "prefill").glob("*.json")):
        record = load_choice(path)
        if record is not None and record.get("bundle") == digest and isinstance(record.get("device"), dict):
            found.append(record)
    return found


def describe_choice(record: dict) -> str:
    """One line of ``info``: which runtime prefills on the record's device, and why."""
    device = record["device"]
    where = f"{device.get('name', '?')} (threads {device.get('threads', '?')})"
    if "speedup" in record:
        why = f"OpenVINO measured {record['speedup']:.2f}x ONNX Runtime's speed on {record.get('rows', '?')} rows"
    else:
        why = str(record.get("error", "not measured"))
    return f"prefill on {where}: {record['runtime']} ({why})"
