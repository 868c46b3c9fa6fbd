"""One target pass, ours against onnxruntime-genai's graph, without the profiler (its per-node cost is larger on our
897-node graph than on genai's 343), interleaved.

Usage:
  python benchmarks/pass_vs_genai.py BUNDLE GENAI_DIR --threads 2 --past 256 --widths 1 2 5 8 --rounds 6 --reps 20
  python benchmarks/pass_vs_genai.py BUNDLE GENAI_DIR --past 1024 --widths 1 2

BUNDLE's target through our engine (one-row passes padded to the bundle's minimum width, as decoding runs them),
after a prefill of ``--past`` random tokens; GENAI_DIR (``benchmarks/peers.py``'s ``genai_model`` builds one) run
on the same tokens as onnxruntime-genai runs it (``past_present_share_buffer``: one K/V buffer per layer and kind
bound as past and present, written in place; ``GenaiGraph``), one-row passes unpadded. Both in one process on the
same thread pool. Prints the median ms per pass of each width and the ratio ours / genai.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import CpuThreads, cpu_session_options

PREFILL_CHUNK = 256  # rows of each prefill pass (``GenaiGraph.prefill``)


class GenaiGraph:
    """onnxruntime-genai's decoder graph driven as onnxruntime-genai drives it (``past_present_share_buffer``): one
    K/V buffer of ``capacity`` slots per layer and kind, bound as both the past input and the present output, each
    pass writing its rows in place after the ``length`` slots committed so far.

    Feeding the past and reading separate presents (what this class did before 2026-12-06) computes wrong logits after
    a past with this graph on onnxruntime 1.32: a one-row step 25.9 off (logits) against a whole prefill of the same
    ids, where the shared buffer is 0.34 off (int8 rounding of one row against many); its timings were not genai's."""

    def __init__(self, folder: Path, threads: int, options: ort.SessionOptions | None = None, capacity: int = 2048):
        """``options``: the session's (default: our engines' CPU options and thread pool for ``threads``)."""
        config = json.loads((folder / "genai_config.json").read_text())["model"]
        dec = config["decoder"]
        self.path, self.names, self.vocab_size = folder / dec["filename"], dec["inputs"], config["vocab_size"]
        self.layers, self.kv_heads, self.head = dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"]
        options = options or cpu_session_options(CpuThreads(threads))
        self.session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        shape = (1, self.kv_heads, capacity, self.head)
        self.buffers = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)) for _ in range(2 * self.layers)]
        self.capacity, self.length = capacity, 0
        self.binding = self.session.io_binding()  # the buffers bound once; each pass rebinds ids, mask, logits
        for i in range(self.layers):
            for j, (kind, name) in enumerate((("key", "past_key_names"), ("value", "past_value_names"))):
                self.binding.bind_ortvalue_input(self.names[name] % i, self.buffers[2 * i + j])
                self.binding.bind_ortvalue_output(f"present.{i}.{kind}", self.buffers[2 * i + j])

    def run(self, ids) -> np.ndarray:
        """The logits of a pass over ``ids`` after the committed slots; its K/V land after them, uncommitted."""
        if self.length + len(ids) > self.capacity:
            raise ValueError(f"{self.length} + {len(ids)} slots exceed the buffers' {self.capacity}: a larger capacity")
        self.binding.bind_cpu_input(self.names["input_ids"], np.asarray(ids, np.int64)[None])
        self.binding.bind_cpu_input(self.names["attention_mask"], np.ones((1, self.length + len(ids)), np.int64))
        self.binding.bind_output("logits")  # unallocated again: its shape follows the pass's rows
        self.session.run_with_iobinding(self.binding)
        return self.binding.get_outputs()[-1].numpy()

    def commit(self, n: int) -> None:
        self.length += n

    def prefill(self, ids, chunk: int = PREFILL_CHUNK) -> None:
        """From empty: ``ids`` in passes of ``chunk`` rows, committed."""
        self.length = 0
        for start in range(0, len(ids), chunk):
            part = ids[start : start + chunk]
            self.run(part)
            self.commit(len(part))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("genai", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 5, 8])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    graph = read_manifest(args.bundle).target.graph
    ours = OrtEngine(args.bundle / graph.path, graph, cpu=CpuThreads(args.threads))
    genai = GenaiGraph(args.genai, args.threads, capacity=args.past + max(args.widths))
    rng = np.random.default_rng(0)
    context = rng.integers(0, graph.vocab_size, args.past)
    ours.run(context, logits_to_keep=1)
    ours.commit(args.past)
    genai.prefill(context)
    times = {(who, w): [] for who in ("ours", "genai") for w in args.widths}
    for _ in range(args.rounds):
        for w in args.widths:
            ids = rng.integers(0, graph.vocab_size, w)
            start = time.perf_counter()
            for _ in range(args.reps):
                ours.run(ids)
                ours.rollback(args.past)
            times[("ours", w)].append((time.perf_counter() - start) / args.reps * 1e3)
            start = time.perf_counter()
            for _ in range(args.reps):
                genai.run(ids)  # not committed: every run lands in the same slots
            times[("genai", w)].append((time.perf_counter() - start) / args.reps * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"threads {args.threads}, past {args.past}; ms per pass, median of {args.rounds} rounds x {args.reps}")
    print("| width | ours | genai | ours / genai |\n|---:|---:|---:|---:|")
    for w in args.widths:
        a, b = med[("ours", w)], med[("genai", w)]
        print(f"| {w} | {a:.2f} | {b:.2f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
