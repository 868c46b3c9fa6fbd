"""A projection past the models this machine holds: the target pass's cost over width and context for
random-weight Llama-shaped graphs at 0.5B, 1B and 3B, ours beside onnxruntime-genai's int4 graph of the same
shape, and the speedup that the acceptance measured on SmolLM2 would give at each size. A projection, not a
measurement of those models: the weights are random, the acceptance is SmolLM2-135M's.

Usage:
  python benchmarks/projection.py --acceptance bench.json --json projection.json  # all sizes, ~30-60 min
  python benchmarks/projection.py --sizes 135m --layers 1 2 --contexts 64 --widths 1 2 --rounds 1   # a check

Method (docs/PERFORMANCE.md, "Past this machine"):
* Shapes: 135m = SmolLM2-135M (the default model: checks the method against ``--bundle``, the real bundle timed in
  the same run), 0.5b = Qwen2.5-0.5B's sizes as a Llama (its q/k/v biases left out), 1b = Llama-3.2-1B,
  3b = Llama-3.2-3B; tied embeddings, as all four have.
* Ours: the graph our exporter builds for ``--dtype gguf`` (``export.graph.build_decoder``, ort flavour), from
  random GGUF-style blocks: every decoder linear Q4_1 (4-bit, blocks of 32, scale and minimum per block), the
  tied embedding / LM head Q8_0, as in SmolLM2's Q4_1 GGUF. Timed through our engine (in-place cache), one-row
  passes unpadded (our gguf bundles pad them to 2 rows: plain decoding costs the S=2 pass).
* onnxruntime-genai: its builder (``onnxruntime_genai.models.builder -p int4 -e cpu``, as benchmarks/peers.py
  runs it) on a random-weight Hugging Face folder of the same shape; timed as onnxruntime-genai runs the graph
  (past and present in one shared K/V buffer; ``pass_vs_genai.GenaiGraph``). Skipped, with the reason, where it does
  not build.
* Depth: a full 1B or 3B graph does not fit this machine's time and memory budget, so each shape is built with
  ``--layers`` (default 2 and 8) decoder layers at its real width, vocabulary and heads. A pass's cost is linear
  in the layer count (every layer the same work), so per width and context: per-layer cost = (t(8) - t(2)) / 6,
  fixed cost (embedding, final norm, LM head) = t(2) - 2 x per-layer, full depth = fixed + layers x per-layer.
* Timing: the cache filled by a prefill of random tokens to each ``--contexts`` length, then ``--rounds`` rounds
  over the widths, ``--reps`` passes each, interleaved; the median pass. Same threads for both runtimes.
* Speedup: from a ``specdec-edge bench --json`` report (``--acceptance``; e.g. of the default gguf bundle with
  ``--methods plain,auto,pld``): per method, how many passes verified how many rows (``by_proposer`` widths + the
  target's own row) and the tokens they emitted. Projected decode speedup = tokens x t(2) / sum over passes of
  t(rows) (rows below --plain-width padded to it; widths between those measured interpolated linearly, beyond them
  extrapolated from the last two). Proposers' own cost (an EAGLE head's passes) and the loop's are left out:
  for prompt lookup they are ~1-3 % here; for head methods the projection is an upper bound.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.bundle.schema import CacheSpec, GraphSpec
from specdec_edge.export.arch import LLAMA
from specdec_edge.export.exporter import contract_inputs, contract_outputs
from specdec_edge.export.graph import EMBED, DecoderConfig, build_decoder, save
from specdec_edge.export.quant_weights import BlockQuantized
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import CpuThreads

# Plain decoding's pass: one row where the device's verdict lets one-row passes run (the graph pads only its
# attention op inside: AVX-512 machines measured so far), two rows where it pads them (the AVX2 machine).
# --plain-width sets it; `specdec-edge info BUNDLE` prints the verdict's "one-row form" on this device.
PLAIN_WIDTH = 1


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "135m": Shape(576, 30, 9, 3, 1536, 49152, 1e5),  # SmolLM2-135M: the default model (method check)
    "0.5b": Shape(896, 24, 14, 2, 4864, 151936, 1e6),  # Qwen2.5-0.5B's sizes
    "1b": Shape(2048, 16, 32, 8, 8192, 128256, 5e5),  # Llama-3.2-1B
    "3b": Shape(3072, 28, 24, 8, 8192, 128256, 5e5),  # Llama-3.2-3B
}


# ---- our graph from random GGUF-style blocks


def q4_1(rng, n: int, k: int, std: float = 0.02) -> BlockQuantized:
    """Random Q4_1 blocks of an [n, k] weight, values ~ std around 0 (w = d q + m, q 0..15)."""
    d = np.full((n, k // 32), std / 4.6, np.float32) * rng.uniform(0.5, 1.5, (n, k // 32)).astype(np.float32)
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    return BlockQuantized(4, 32, q, d, np.zeros_like(d, np.uint8), (-7.5 * d).astype(np.float32))


def q8_0(rng, n: int, k: int, std: float = 0.02) -> BlockQuantized:
    """Random Q8_0 blocks (w = d q, q int8 stored + 128)."""
    d = np.full((n, k // 32), std / 74.0, np.float32)
    q = rng.integers(0, 256, (n, k), dtype=np.uint8)
    return BlockQuantized(8, 32, q, d, np.full_like(d, 128, np.uint8))


def decoder_config(shape: Shape, layers: int, capacity: int, seed: int = 0) -> DecoderConfig:
    """A Llama DecoderConfig of ``shape`` with ``layers`` layers: random GGUF-style blocks for every linear and the
    tied table, unit norms, plain rotary tables. The float weights the builder looks up only for shapes are
    ``np.zeros`` (never touched, so never paged in)."""
    rng = np.random.default_rng(seed)
    h, hd, inter = shape.hidden, shape.head_dim, shape.intermediate
    sizes = {"q_proj": (shape.heads * hd, h), "k_proj": (shape.kv_heads * hd, h), "v_proj": (shape.kv_heads * hd, h)}
    sizes |= {"o_proj": (h, shape.heads * hd)}
    weights, quantized = {"model.norm.weight": np.ones(h, np.float32)}, {}
    weights[EMBED] = np.zeros((shape.vocab, h), np.float32)
    quantized[EMBED] = q8_0(rng, shape.vocab, h)
    for i in range(layers):
        p = f"model.layers.{i}"
        weights[p + ".input_layernorm.weight"] = np.ones(h, np.float32)
        weights[p + ".post_attention_layernorm.weight"] = np.ones(h, np.float32)
        named = {f"{p}.self_attn.{n}.weight": s for n, s in sizes.items()}
        named |= {f"{p}.mlp.{n}.weight": (inter, h) for n in ("gate_proj", "up_proj")}
        named |= {f"{p}.mlp.down_proj.weight": (h, inter)}
        for name, (n, k) in named.items():
            weights[name] = np.zeros((n, k), np.float32)
            quantized[name] = q4_1(rng, n, k)
    inv = 1.0 / shape.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    angles = np.outer(np.arange(capacity), inv)
    rope = {"full_attention": (np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))}
    return DecoderConfig(
        arch=LLAMA,
        vocab_size=shape.vocab,
        hidden_size=h,
        num_layers=layers,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=hd,
        rms_eps=1e-5,
        attn_scale=hd**-0.5,
        layer_types=["full_attention"] * layers,
        sliding_window=None,
        rope=rope,
        weights=weights,
        quantized=quantized,
    )


def our_engine(shape: Shape, layers: int, capacity: int, folder: Path, threads: int) -> OrtEngine:
    """Build (once) and load our gguf-style graph of ``shape`` with ``layers`` layers."""
    path = folder / "model.onnx"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        cfg = decoder_config(shape, layers, capacity)
        save(build_decoder(cfg, flavour="ort", dtype="gguf", capacity=capacity, hidden_states=False), path)
        del cfg
        gc.collect()
    cfg = SimpleNamespace(
        num_layers=layers, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab
    )
    spec = GraphSpec(
        path="model.onnx",
        flavour="ort",
        dtype="gguf",
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        cache=CacheSpec(layers, shape.kv_heads, shape.head_dim, capacity, "float32"),
        capacity_bias=True,
        inputs=contract_inputs(cfg, capacity, "float32"),
        outputs=contract_outputs(cfg, capacity, "float32", False),
    )
    return OrtEngine(str(path), spec, cpu=CpuThreads(threads))


# ---- onnxruntime-genai's graph of the same shape


def genai_folder(shape: Shape, layers: int, work: Path) -> Path:
    """Build (once) onnxruntime-genai's int4 CPU graph from a random-weight Hugging Face folder of the shape."""
    out = work / "genai-int4"
    if (out / "genai_config.json").is_file():
        return out
    hf = work / "hf"
    if not (hf / "config.json").is_file():
        from safetensors.numpy import save_file
        from transformers import LlamaConfig

        hf.mkdir(parents=True, exist_ok=True)
        config = LlamaConfig(
            vocab_size=shape.vocab,
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_hidden_layers=layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            rope_theta=shape.rope_theta,
            tie_word_embeddings=True,
            architectures=["LlamaForCausalLM"],
            bos_token_id=1,
            eos_token_id=2,
            max_position_embeddings=4096,
            torch_dtype="float16",
        )
        config.save_pretrained(hf)
        tiny_tokenizer(hf)  # the builder copies a tokenizer; its vocabulary does not matter for a pass's cost
        rng = np.random.default_rng(1)
        normal = lambda n, k: (rng.standard_normal((n, k), np.float32) * 0.02).astype(np.float16)  # noqa: E731
        tensors = {"model.embed_tokens.weight": normal(shape.vocab, shape.hidden)}
        tensors["model.norm.weight"] = np.ones(shape.hidden, np.float16)
        for name, (n, k) in linear_shapes(shape, layers).items():
            tensors[name] = normal(n, k)
        for i in range(layers):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                tensors[f"model.layers.{i}.{norm}.weight"] = np.ones(shape.hidden, np.float16)
        save_file(tensors, str(hf / "model.safetensors"))
        del tensors
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out)]
    cmd += ["-p", "int4", "-e", "cpu", "-c", str(work / "cache")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not (out / "genai_config.json").is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError("onnxruntime-genai's builder failed: " + " | ".join(tail))
    return out


def tiny_tokenizer(folder: Path) -> None:
    """A three-token tokenizer saved in ``folder`` (onnxruntime-genai's builder reads and copies one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def linear_shapes(shape: Shape, layers: int) -> dict[str, tuple[int, int]]:
    h, hd = shape.hidden, shape.head_dim
    out = {}
    for i in range(layers):
        p = f"model.layers.{i}"
        out[f"{p}.self_attn.q_proj.weight"] = (shape.heads * hd, h)
        out[f"{p}.self_attn.k_proj.weight"] = (shape.kv_heads * hd, h)
        out[f"{p}.self_attn.v_proj.weight"] = (shape.kv_heads * hd, h)
        out[f"{p}.self_attn.o_proj.weight"] = (h, shape.heads * hd)
        out[f"{p}.mlp.gate_proj.weight"] = (shape.intermediate, h)
        out[f"{p}.mlp.up_proj.weight"] = (shape.intermediate, h)
        out[f"{p}.mlp.down_proj.weight"] = (h, shape.intermediate)
    return out


# ---- timing


def time_ours(engine: OrtEngine, contexts, widths, rounds: int, reps: int, vocab: int) -> dict:
    """{context: {width: median ms}} of our engine's passes after a prefill of ``context`` random tokens."""
    rng, out = np.random.default_rng(2), {}
    for ctx in contexts:
        engine.reset()
        for start in range(0, ctx, 256):
            chunk = rng.integers(0, vocab, min(256, ctx - start))
            engine.run(chunk, logits_to_keep=1)
            engine.commit(len(chunk))
        times = {w: [] for w in widths}
        for _ in range(rounds):
            for w in widths:
                ids = rng.integers(0, vocab, w)
                engine.run(ids)  # warm-up of this shape
                for _ in range(reps):
                    t0 = time.perf_counter()
                    engine.run(ids)  # not committed: every pass writes the same slots
                    times[w].append((time.perf_counter() - t0) * 1e3)
        out[ctx] = {w: statistics.median(v) for w, v in times.items()}
    return out


def time_genai(folder: Path, threads: int, contexts, widths, rounds: int, reps: int) -> dict:
    from pass_vs_genai import GenaiGraph  # benchmarks/, beside this script

    capacity = max(contexts) + max(widths)
    graph, rng, out = GenaiGraph(folder, threads, capacity=capacity), np.random.default_rng(2), {}
    for ctx in contexts:
        graph.prefill(rng.integers(0, graph.vocab_size, ctx))
        times = {w: [] for w in widths}
        for _ in range(rounds):
            for w in widths:
                ids = rng.integers(0, graph.vocab_size, w)
                graph.run(ids)  # not committed: every pass writes the same slots
                for _ in range(reps):
                    t0 = time.perf_counter()
                    graph.run(ids)
                    times[w].append((time.perf_counter() - t0) * 1e3)
        out[ctx] = {w: statistics.median(v) for w, v in times.items()}
    return out


def full_depth(by_layers: dict, layers: int) -> dict:
    """{context: {width: ms}} at ``layers`` layers, linear in the layer count through the two smallest measured.

    NaN where the deeper graph did not measure slower than the shallower one, or the fixed part came out negative:
    the difference is noise there (a run of 2026-12-02 with 2 rounds printed negative passes), so nothing is
    projected from it; more ``--rounds``/``--reps`` or a wider ``--layers`` pair are the fix."""
    (l1, a), (l2, b) = sorted(by_layers.items())[:2]
    out = {}
    for ctx in a:
        out[ctx] = {}
        for w in a[ctx]:
            per_layer = (b[ctx][w] - a[ctx][w]) / (l2 - l1)
            fixed = a[ctx][w] - l1 * per_layer
            out[ctx][w] = fixed + layers * per_layer if per_layer > 0 and fixed >= 0 else float("nan")
    return out


# ---- projected speedup


def pass_cost(costs: dict, rows: int) -> float:
    """ms of a pass of ``rows`` rows (padded to PLAIN_WIDTH) from the measured widths, linear in between and beyond."""
    rows = max(rows, PLAIN_WIDTH)
    ws = sorted(costs)
    if rows in costs:
        return costs[rows]
    lo = max([w for w in ws if w < rows], default=ws[0])
    hi = min([w for w in ws if w > rows], default=None)
    if hi is None:  # beyond the widest: the slope of the last two
        lo, hi = ws[-2], ws[-1]
    return costs[lo] + (costs[hi] - costs[lo]) * (rows - lo) / (hi - lo)


def acceptance(report: dict) -> dict:
    """{method: (tokens, Counter(rows per pass -> passes))} from a bench report's overall rows."""
    out = {}
    for method, rows in report["results"].items():
        overall = rows.get("overall") or rows[next(reversed(rows))]
        passes, tokens = Counter(), 0
        for p in overall.get("by_proposer", {}).values():
            tokens += p["accepted"] + p["steps"]
            for width, count in p.get("widths", {}).items():
                passes[int(width) + 1] += count
        if method != "plain" and passes:
            out[method] = (tokens, passes)
    return out


def speedup(costs: dict, tokens: int, passes: Counter) -> float:
    """Decode speedup over plain (one PLAIN_WIDTH pass per token) of these passes at these pass costs."""
    return tokens * pass_cost(costs, 1) / sum(n * pass_cost(costs, rows) for rows, n in passes.items())


# ---- report


def markdown(result: dict, widths) -> str:
    lines = [
        "Target pass, ms, at full depth (projected from the layers measured); S=1: one row, attention padded "
        "to 2 inside the graph (our gguf graphs' one-row form).",
        "",
    ]
    lines.append("| size | context | graph | " + " | ".join(f"S={w}" for w in widths) + " |")
    lines.append("|---|---:|---|" + "---:|" * len(widths))
    for size, r in result["sizes"].items():
        for graph in ("ours", "genai", "bundle"):
            for ctx, row in r.get(graph, {}).get("full", {}).items():
                cells = " | ".join(f"{row[w]:.1f}" for w in widths)
                lines.append(f"| {size} | {ctx} | {graph} | {cells} |")
        if "genai_skipped" in r:
            lines.append(f"| {size} | | genai | skipped: {r['genai_skipped']} |")
    if result.get("speedups"):
        head = f"Projected decode speedup over our plain decoding (S={PLAIN_WIDTH} passes), and decode tok/s:"
        lines += ["", head, ""]
        lines.append(
            "| size | context | method | tokens/pass (measured) | speedup | ours plain tok/s | ours method tok/s "
            "| genai int4 plain tok/s |"
        )
        lines.append("|---|---:|---|---:|---:|---:|---:|---:|")
        for s in result["speedups"]:
            genai = f"{s['genai_plain_tok_s']:.0f}" if s["genai_plain_tok_s"] else "–"
            lines.append(
                f"| {s['size']} | {s['context']} | {s['method']} | {s['tokens_per_pass']:.2f} | {s['speedup']:.2f}x "
                f"| {s['plain_tok_s']:.0f} | {s['method_tok_s']:.0f} | {genai} |"
            )
    return "\n".join(lines)


def main() -> None:
    global PLAIN_WIDTH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="135m,0.5b,1b,3b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--layers", type=int, nargs=2, default=[2, 8], help="the two depths built and timed")
    ap.add_argument(
        "--plain-width",
        type=int,
        choices=(1, 2),
        default=PLAIN_WIDTH,
        help="rows of plain decoding's pass on this device (1: one-row passes run; 2: padded)",
    )
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 5, 8])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--work", type=Path, default=Path("/tmp/projection"), help="graphs built (reused if there)")
    ap.add_argument("--acceptance", type=Path, default=None, help="a `specdec-edge bench --json` report")
    ap.add_argument("--bundle", type=Path, default=None, help="a real 135m bundle to time beside its projection")
    ap.add_argument("--skip-genai", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    PLAIN_WIDTH = args.plain_width
    if PLAIN_WIDTH not in args.widths:
        sys.exit(f"--widths must include {PLAIN_WIDTH} (--plain-width: plain decoding's pass)")
    capacity = max(args.contexts) + max(args.widths) + 16
    result = {"meta": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "sizes": {}}
    result["meta"]["started"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    for size in args.sizes.split(","):
        shape, r = SHAPES[size], {}
        for graph in ("ours", "genai"):
            if graph == "genai" and args.skip_genai:
                r["genai_skipped"] = "--skip-genai"
                continue
            measured = {}
            for layers in args.layers:
                work = args.work / f"{size}-L{layers}-c{capacity}"
                print(f"{size}: {graph}, {layers} layers", file=sys.stderr)
                try:
                    if graph == "ours":
                        engine = our_engine(shape, layers, capacity, work / "ours", args.threads)
                        t = time_ours(engine, args.contexts, args.widths, args.rounds, args.reps, shape.vocab)
                        del engine
                    else:
                        folder = genai_folder(shape, layers, work)
                        t = time_genai(folder, args.threads, args.contexts, args.widths, args.rounds, args.reps)
                except (ImportError, RuntimeError) as e:
                    r["genai_skipped"] = str(e)
                    print(f"{size}: onnxruntime-genai skipped: {e}", file=sys.stderr)
                    break
                gc.collect()
                measured[layers] = t
            if len(measured) == 2:
                r[graph] = {"measured": measured, "full": full_depth(measured, shape.layers)}
        if size == "135m" and args.bundle:
            g = read_manifest(args.bundle).target.graph
            engine = OrtEngine(str(args.bundle / g.path), g, cpu=CpuThreads(args.threads))
            engine.min_width = 1  # the widths as asked, as for the random graphs
            r["bundle"] = {"full": time_ours(engine, args.contexts, args.widths, args.rounds, args.reps, g.vocab_size)}
            del engine
        result["sizes"][size] = r
    if args.acceptance:
        result["speedups"] = []
        for method, (tokens, passes) in acceptance(json.loads(args.acceptance.read_text())).items():
            for size, r in result["sizes"].items():
                for ctx, costs in r.get("ours", {}).get("full", {}).items():
                    x = speedup(costs, tokens, passes)
                    plain = 1e3 / pass_cost(costs, 1)
                    genai = r.get("genai", {}).get("full", {}).get(ctx, {}).get(1)  # genai decodes one row
                    result["speedups"].append(
                        {
                            "size": size,
                            "context": ctx,
                            "method": method,
                            "tokens_per_pass": tokens / sum(passes.values()),
                            "speedup": x,
                            "plain_tok_s": plain,
                            "method_tok_s": plain * x,
                            "genai_plain_tok_s": 1e3 / genai if genai else None,
                        }
                    )
    print(markdown(result, args.widths))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
