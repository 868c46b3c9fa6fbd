"""Which runtime prefills the target on this device: measured once per device and bundle, then cached.

``--prefill auto`` (the default) may prefill the target's cache with another runtime than the target graph's
ONNX Runtime session: OpenVINO (``runtime/ov_prefill.py``, where it is installed) or the bundle's prefill graph
(``runtime/graph_prefill.py``, where the bundle has one: its 4-bit layers with fp32 activations). Which is faster
depends on the CPU: on an AVX-512 one OpenVINO ran 256-row passes of the default gguf bundle 1.3-1.7x faster than
ONNX Runtime, on an AVX2-only one 0.84x as fast, where the prefill graph ran 1.09x (docs/lab/prefill-and-passes.md).
So ``choose_prefill`` times every candidate and the target graph on the same rows (a prompt's second chunk; each
candidate right after a pass of the target graph, the least of a few passes each, after each ran once and its K/V
were checked against the target graph's) and keeps the fastest candidate only where it is at least ``GAIN`` times
faster than the target graph (the prefill graph, which also brings the prompt's K/V to the fp32 model's, unless it
is clearly slower: ``GAINS``). The choice is cached per bundle and device (``<cache>/prefill/``, written atomically),
so a device always prefills the same way: the output of a call depends on which runtime prefilled it (two roundings
of the same model), and it must not change from one load to the next. ``--prefill openvino`` / ``fp32`` /
``onnxruntime`` pin it.
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
from specdec_edge.runtime.graph_prefill import open_graph_prefill
from specdec_edge.runtime.ov_prefill import PREFILL_RUNTIMES, open_prefill
from specdec_edge.runtime.threads import CpuThreads
from specdec_edge.user_cache import cache_dir

CHOICE_FORMAT = 6  # bumped when what is measured or how it decides changes: older records are measured again
ROWS = 256  # a prefill chunk of ONNX Runtime's (PREFILL_CHUNK), timed after as many committed slots
ROUNDS = 3  # timed passes per candidate, each after one of the target graph; the least of each is compared
GAIN = 1.1  # another runtime prefills only where its pass takes at most 1/GAIN of the target graph's ...
# ... except the prefill graph, kept unless it is clearly slower: it computes the prompt's K/V as the fp32 model does
# (3e-6 relative error against the fp32 export's, where the target graph's int8 activations give 5e-2; greedy
# output's common prefix with the fp32 model 27.4 tokens against 21.7 on 26 Spec-Bench prompts), while OpenVINO's
# roundings are no closer to fp32 than ONNX Runtime's. On an AVX2 CPU it runs at 0.97-1.08x the target graph's
# speed from one measurement to the next (docs/lab/prefill-and-passes.md): a bar at 1.0 would choose by noise.
GAINS = {"fp32": 0.95}
# A candidate whose first timed pass took longer than 1 / (OUT * its bar) of the target graph's is not timed again:
# no later pass of a 3-round least would bring it up to its bar (OpenVINO on an AVX2 CPU: 0.57-0.84x against 1.1;
# the two rounds it skips are ~3 s of a first load there). Nor is one whose speedup is under OUT times a paying
# candidate's: it would not be chosen (the prefill graph on an AVX-512 CPU, ~1.0x beside OpenVINO's ~1.5x: ~1.6 s
# of a first load there).
OUT = 0.8


def open_prefillers(choice: str, provider: str, root: Path, graph, cpu: CpuThreads) -> list:
    """The prefillers ``--prefill choice`` allows for the target ``graph`` of the bundle at ``root``: none for
    "onnxruntime" (or "auto" off the CPU); the one asked for, ready (its errors surface at load), for "openvino" or
    "fp32"; for "auto" every one that could run here (OpenVINO where installed, the prefill graph where the bundle
    has one), for ``choose_prefill`` to time."""
    if choice not in PREFILL_RUNTIMES:
        raise SpecdecError(f"unknown prefill runtime {choice!r}; choose one of {', '.join(PREFILL_RUNTIMES)}.")
    if provider != "cpu":
        if choice in ("openvino", "fp32"):
            raise SpecdecError(
                f"prefill {choice!r} runs on the CPU, beside provider 'cpu'; with provider {provider!r} use "
                "--prefill onnxruntime (or auto)."
            )
        return []
    found = []
    if choice in ("openvino", "auto"):
        openvino = open_prefill(choice, provider, Path(root) / graph.path, graph, cpu.threads)
        found += [openvino] if openvino is not None else []
    if choice in ("fp32", "auto"):
        graph_prefill = open_graph_prefill(root, graph, cpu)
        if graph_prefill is None and choice == "fp32":
            raise SpecdecError(
                "prefill 'fp32' needs the bundle's prefill graph, and this bundle has none (exported before it "
                "existed, or without 4-bit layers); re-export the bundle, or use --prefill onnxruntime (or auto)."
            )
        if graph_prefill is not None and choice == "fp32":
            graph_prefill.required = True
            graph_prefill.compile()
        found += [graph_prefill] if graph_prefill is not None else []
    return found


def choice_path(digest: str, graph_path: str, device: dict) -> Path:
    key = json.dumps([CHOICE_FORMAT, digest, graph_path, device_key(device)])
    return cache_dir() / "prefill" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")


def measure_prefill(engine, candidates: list, rows: int = ROWS, rounds: int = ROUNDS) -> dict:
    """Seconds of one prefill pass of ``rows`` random tokens after ``rows`` committed ones (the second chunk of a
    long prompt, where prefill time goes) by the target graph (``engine.run``) and by each of ``candidates``
    (prefillers): ``{"rows", "past", "seconds": {name: s}, "speedups": {name: x}, "errors": {name: why}}``. A
    candidate that cannot run the graph or disagrees with the target graph (``OrtEngine``'s check) is left out, with
    why; one far below its bar or another candidate after a round (``contenders``) is timed no more. The engine's
    cache is left empty and no prefiller attached."""
    rows = max(1, min(rows, engine.capacity // 4))
    ids = np.random.default_rng(0).integers(0, engine.vocab_size, size=2 * rows)
    context, part = ids[:rows], ids[rows:]
    times: dict[str, list[float]] = {"onnxruntime": []}
    errors, usable = {}, []
    engine.reset()
    try:
        engine.run(context, logits_to_keep=1)  # every pass below writes only the slots after it: it stays
        engine.commit(rows)
        for candidate in candidates:  # each runs once (warm-up) and its K/V are checked
            engine.prefiller = candidate
            try:
                engine.check_prefiller(part, 1)
            except SpecdecError as e:
                errors[candidate.name] = str(e)
                continue
            usable.append(candidate)
            times[candidate.name] = []
        for _ in range(rounds):
            for candidate in usable:  # the target graph right before each candidate: a runtime whose threads spin
                start = time.perf_counter()  # on after its pass (OpenVINO's) slows the next pass, never another's
                engine.run(part, logits_to_keep=1)
                times["onnxruntime"].append(time.perf_counter() - start)
                start = time.perf_counter()
                candidate.run(engine.cache, rows, engine.step_inputs(part, None, None, 1))
                times[candidate.name].append(time.perf_counter() - start)
            usable = contenders(usable, times)
    finally:
        engine.prefiller = None
        engine.reset()
    best = {name: min(t) for name, t in times.items() if t}
    base = best.get("onnxruntime")
    return {
        "rows": rows,
        "past": rows,
        "seconds": {name: round(t, 6) for name, t in best.items()},
        "speedups": {name: round(base / max(t, 1e-9), 4) for name, t in best.items() if name != "onnxruntime"},
        "errors": errors,
    }


def contenders(usable: list, times: dict[str, list[float]]) -> list:
    """The candidates of ``usable`` worth another timed round: each one's speedup so far (its least time against
    the target graph's) at least ``OUT`` times its bar and ``OUT`` times the best speedup of a candidate that clears
    its own bar (``decide`` chooses the fastest of those); a round's least can fall, but not by a quarter."""
    if not usable:
        return []
    base = min(times["onnxruntime"])
    speedup = {c.name: base / min(times[c.name]) for c in usable}
    lead = max((x for name, x in speedup.items() if x >= bar(name)), default=0.0)
    return [c for c in usable if speedup[c.name] >= OUT * max(bar(c.name), lead)]


RUNTIMES = ("onnxruntime", "openvino", "fp32")  # what a record may name (``ov_prefill.PREFILL_RUNTIMES`` less auto)


def load_choice(path: Path) -> dict | None:
    """The cached record at ``path``, or None where there is none or it is not one this version wrote."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != CHOICE_FORMAT:
        return None
    return data if data.get("runtime") in RUNTIMES else None


def bar(name: str) -> float:
    """The speedup over the target graph at which the candidate ``name`` prefills (``GAINS``, else ``GAIN``)."""
    return GAINS.get(name, GAIN)


def decide(measured: dict) -> str:
    """The fastest candidate of a measurement among those at least their gain (``bar``) times the target graph's
    speed, else "onnxruntime" (the target graph prefills)."""
    speedups = measured.get("speedups") or {}
    paying = {name: x for name, x in speedups.items() if x >= bar(name)}
    return max(paying, key=paying.get) if paying else "onnxruntime"


def choose_prefill(root, graph_path: str, engine, candidates: list, device: dict, progress: Progress | None = None):
    """The prefiller of ``candidates`` that ``engine`` should keep under ``--prefill auto``: the one a cached or a
    new measurement on ``device`` says prefills at least ``GAIN`` times faster than the target graph, else None.
    The measurement checks each candidate's K/V against the target graph's; a prefiller chosen by a cached record
    and whose check holds per device (the prefill graph) is not checked again at its first pass."""
    digest = bundle_digest(root)
    path = choice_path(digest, graph_path, device)
    record = load_choice(path)
    cached = record is not None
    if not cached:
        names = " and ".join(c.name for c in candidates)
        report(
            progress,
            f"specdec-edge: timing the {names} prefill against the target graph's on {device.get('name')}; once per "
            "device, ~10 s on 2 cores (a compile and a few timed passes)",
        )
        measured = measure_prefill(engine, candidates)
        record = {"format": CHOICE_FORMAT, "bundle": digest, "graph": graph_path, "device": device, **measured}
        record["runtime"] = decide(measured)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(record, indent=1))
            where = f"; cached in {path}"
        except OSError:
            where = " (the cache is not writable: measured again next time)"
        report(progress, f"specdec-edge: {record['runtime']} prefills here ({why(record)}){where}")
    chosen = next((c for c in candidates if c.name == record["runtime"]), None)
    if cached and chosen is not None and chosen.check_holds_per_device:
        # only a candidate whose check passed is ever chosen, and what it computes here has not changed since
        chosen.checked = True
    return chosen


def why(record: dict) -> str:
    """What a record measured: each candidate's speed against the target graph's, or why it could not run."""
    parts = [f"{name} {x:.2f}x" for name, x in (record.get("speedups") or {}).items()]
    parts += [f"{name} failed: {error}" for name, error in (record.get("errors") or {}).items()]
    rows, past = record.get("rows", "?"), record.get("past", 0)
    where = f"{rows} rows after {past}" if past else f"{rows} rows"
    return f"against the target graph's speed on {where}: " + "; ".join(parts) if parts else "nothing measured"


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
    return f"prefill on {where}: {record['runtime']} ({why(record)})"
