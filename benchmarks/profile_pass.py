"""Where one target pass's time goes: ONNX Runtime's profiler, per op type and per layer.

Usage:
  python benchmarks/profile_pass.py BUNDLE [BUNDLE ...] --contexts 256 1500 --widths 1 2 5 8 --prefill 256
  python benchmarks/profile_pass.py BUNDLE --genai /tmp/peer-models/genai-int4   # and onnxruntime-genai's graph

For each bundle and context, the cache is filled by a real chunked prefill of random tokens, then passes of
each width S (and one prefill chunk of ``--prefill`` tokens) run ``--repeats`` times after 2 warm-ups through
the runtime's own engine (so a 1-row pass runs padded to the bundle's minimum width, as in decoding). Each pass
is rolled back. The profile's kernel times are assigned to the pass whose ``model_run`` they fall in.

Prints Markdown tables: ms per pass by op type in the timed pass with the least wall time (load only adds),
the whole pass (least and median wall of ``model_run``), and by part of the graph (the decoder layers, the LM
head, the rest).

``--genai DIR``: also an onnxruntime-genai model folder (``benchmarks/peers.py`` builds one: ``genai_model``), its
``model.onnx`` run the way onnxruntime-genai runs it (past and present in one shared buffer,
``pass_vs_genai.GenaiGraph``; one-row passes unpadded), the same contexts, widths and chunk, with its own node names
split into layers / LM head / rest.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx

import specdec_edge.runtime.ort_engine as ort_engine
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import CpuThreads, cpu_session_options

LAYER_REF = re.compile(r"(?:model\.layers|past_key_values)\.(\d+)\.")
NODE_NAME = re.compile(r"n_[A-Za-z]+_\d+")  # export/graph.py's node names; fused nodes keep one of them


def part_of(name: str, parts: dict[str, str]) -> str:
    if name in parts:
        return parts[name]
    return next((parts[m] for m in NODE_NAME.findall(name) if m in parts), "other")


def node_parts(model_path: Path) -> dict[str, str]:
    """Node name -> "layers", "lm_head" or "other": the graph is emitted in order, so a node belongs to the
    layer of the last node before it that read one of that layer's weights or cache."""
    model = onnx.load(str(model_path), load_external_data=False)
    parts, where = {}, "other"
    for node in model.graph.node:
        refs = [m.group(1) for i in node.input if (m := LAYER_REF.match(i))]
        if refs:
            where = "layers"
        elif where == "layers" and any(i == "model.norm.weight" for i in node.input):
            where = "lm_head"  # the final norm and what follows it
        parts[node.name] = where
    return parts


def profiled_engine(bundle: Path, threads: int, prefix: str) -> OrtEngine:
    g = read_manifest(bundle).target.graph
    plain = ort_engine.cpu_session_options

    def with_profiling(*a, **k):
        opts = plain(*a, **k)
        opts.enable_profiling = True
        opts.profile_file_prefix = prefix
        return opts

    ort_engine.cpu_session_options = with_profiling
    try:
        return OrtEngine(bundle / g.path, g, cpu=CpuThreads(threads))
    finally:
        ort_engine.cpu_session_options = plain


def passes(events: list[dict]) -> list[tuple[float, float, list[dict]]]:
    """(start, duration, its kernel events) of each ``model_run``, in order."""
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    kernels = sorted(
        (e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")), key=lambda e: e["ts"]
    )
    out, j = [], 0
    for r in runs:
        start, end, mine = r["ts"], r["ts"] + r["dur"], []
        while j < len(kernels) and kernels[j]["ts"] < start:
            j += 1
        while j < len(kernels) and kernels[j]["ts"] <= end:
            mine.append(kernels[j])
            j += 1
        out.append((start, r["dur"], mine))
    return out


def profile_bundle(bundle: Path, args) -> dict:
    """{(context, label): {"wall": [ms], "ops": {op: ms per pass}, "parts": {part: ms per pass}}}."""
    g = read_manifest(bundle).target.graph
    parts = node_parts(bundle / g.path)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        engine = profiled_engine(bundle, args.threads, str(Path(tmp) / "p"))
        labels = []  # one per session.run, in order: None (filling, warm-up) or (context, label)
        for ctx in args.contexts:
            engine.reset()
            for start in range(0, ctx, 256):
                chunk = rng.integers(0, g.vocab_size, min(256, ctx - start))
                engine.run(chunk)
                engine.commit(len(chunk))
                labels.append(None)
            cases = [(f"S={s}", s, 1) for s in args.widths] + (
                [(f"P{args.prefill}", args.prefill, 1)] if args.prefill else []
            )
            for label, s, keep in cases:
                ids = rng.integers(0, g.vocab_size, s)
                for i in range(args.repeats + 2):
                    engine.run(ids, logits_to_keep=keep if label.startswith("P") else None)
                    labels.append((ctx, label) if i >= 2 else None)
        profile = engine.session.end_profiling()
        events = json.loads(Path(profile).read_text())
    return breakdown(passes(events), labels, lambda name: part_of(name, parts))


def genai_part(name: str) -> str:
    """onnxruntime-genai builder node names: /model/layers.N/... (layers.<last>/final_norm is the LM head's norm)."""
    if "/lm_head/" in name or "final_norm" in name:
        return "lm_head"
    return "layers" if "/model/layers." in name else "other"


def profile_genai(folder: Path, args) -> tuple[dict, int]:
    """``profile_bundle`` for an onnxruntime-genai model folder (module docstring); also its node count."""
    from pass_vs_genai import PREFILL_CHUNK, GenaiGraph  # benchmarks/, beside this script

    opts = cpu_session_options(CpuThreads(args.threads))  # our engines' pool and options: the same threads
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        opts.enable_profiling, opts.profile_file_prefix = True, str(Path(tmp) / "g")
        widest = max(args.widths + [args.prefill or 0])
        genai = GenaiGraph(folder, args.threads, opts, capacity=max(args.contexts) + widest)
        labels = []
        for ctx in args.contexts:
            genai.prefill(rng.integers(0, genai.vocab_size, ctx))
            labels += [None] * -(-ctx // PREFILL_CHUNK)  # one unlabelled pass per prefill chunk
            cases = [(f"S={s}", s) for s in args.widths] + (
                [(f"P{args.prefill}", args.prefill)] if args.prefill else []
            )
            for label, width in cases:
                ids = rng.integers(0, genai.vocab_size, width)
                for i in range(args.repeats + 2):
                    genai.run(ids)  # not committed: every pass writes the same slots
                    labels.append((ctx, label) if i >= 2 else None)
        events = json.loads(Path(genai.session.end_profiling()).read_text())
    nodes = len(onnx.load(str(genai.path), load_external_data=False).graph.node)
    return breakdown(passes(events), labels, genai_part), nodes


def breakdown(runs: list, labels: list, part) -> dict:
    """Per (context, label): the wall times and, for the least pass, ms by op type and by ``part(node name)``."""
    if len(runs) != len(labels):
        raise RuntimeError(f"{len(runs)} runs profiled, {len(labels)} made")
    acc = defaultdict(lambda: {"wall": [], "ops": {}, "parts": {}})
    for lab, (_, dur, kernels) in zip(labels, runs):
        if lab is None:
            continue
        a = acc[lab]
        a["wall"].append(dur / 1000)
        if dur / 1000 > min(a["wall"]):
            continue
        # the breakdown of the least pass: a shared machine's noise only adds
        ops, where = defaultdict(float), defaultdict(float)
        for k in kernels:
            ms = k["dur"] / 1000
            ops[k["args"].get("op_name", "?")] += ms
            where[part(k["name"].removesuffix("_kernel_time"))] += ms
        a["ops"], a["parts"] = dict(ops), dict(where)
    return acc


def print_table(title: str, acc: dict, top: int) -> None:
    """One graph's Markdown table: ms by op type in the least pass of each column, the pass, the parts."""
    cols = list(acc)  # (context, label) in run order
    print(f"\n#### {title}; ms per pass\n")
    print("| op type | " + " | ".join(f"{lab} @{c}" for c, lab in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    widest = max(cols, key=lambda c: sum(acc[c]["ops"].values()))
    ops = sorted(acc[widest]["ops"], key=lambda o: -acc[widest]["ops"][o])
    shown, rest = ops[:top], ops[top:]
    for op in shown:
        print(f"| {op} | " + " | ".join(f"{acc[c]['ops'].get(op, 0):.2f}" for c in cols) + " |")
    if rest:
        print("| (other ops) | " + " | ".join(f"{sum(acc[c]['ops'].get(o, 0) for o in rest):.2f}" for c in cols) + " |")
    print("| **kernels, sum** | " + " | ".join(f"**{sum(acc[c]['ops'].values()):.2f}**" for c in cols) + " |")
    print("| **pass (model_run, least)** | " + " | ".join(f"**{min(acc[c]['wall']):.2f}**" for c in cols) + " |")
    print("| pass (model_run, median) | " + " | ".join(f"{statistics.median(acc[c]['wall']):.2f}" for c in cols) + " |")
    for part in ("layers", "lm_head", "other"):
        print(f"| part: {part} | " + " | ".join(f"{acc[c]['parts'].get(part, 0):.2f}" for c in cols) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="*", type=Path)
    ap.add_argument("--genai", type=Path, help="an onnxruntime-genai model folder to profile too")
    ap.add_argument("--contexts", nargs="+", type=int, default=[256, 1500])
    ap.add_argument("--widths", nargs="+", type=int, default=[1, 2, 5, 8])
    ap.add_argument("--prefill", type=int, default=256, help="tokens of the prefill chunk (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=12, help="op types listed (by time in the widest pass)")
    ap.add_argument("--tmp", default=None, help="folder for the profiler's JSON files")
    ap.add_argument("--json", type=Path, help="also write the measurements here")
    args = ap.parse_args()
    everything = {}
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    for bundle in args.bundles:
        g = read_manifest(bundle).target.graph
        acc = profile_bundle(bundle, args)
        everything[bundle.name] = {f"{c}/{lab}": v for (c, lab), v in acc.items()}
        nodes = len(onnx.load(str(bundle / g.path), load_external_data=False).graph.node)
        title = f"{bundle.name} ({g.dtype}, {g.flavour}, {nodes} nodes, min pass width {g.verdict.min_pass_width})"
        print_table(title, acc, args.top)
    if args.genai:
        acc, nodes = profile_genai(args.genai, args)
        everything[f"genai:{args.genai.name}"] = {f"{c}/{lab}": v for (c, lab), v in acc.items()}
        print_table(f"onnxruntime-genai {args.genai.name} ({nodes} nodes, shared K/V buffer, unpadded)", acc, args.top)
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1, default=list))


if __name__ == "__main__":
    main()
