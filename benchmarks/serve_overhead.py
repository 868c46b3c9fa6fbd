"""What the HTTP server costs: the same greedy requests through `Pipeline.generate` in this process and
through `specdec-edge serve` (the official openai client, streaming and not), alternated in rounds.

Usage:
  python benchmarks/serve_overhead.py /tmp/b/smol-gguf --method pld --rounds 3 --max-tokens 128

Prints per-path median tokens/s over whole calls (client wall clock; prefill and HTTP included), time to
the first streamed text, and whether every server answer equals the in-process one.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI

from specdec_edge import Pipeline

DATA = Path(__file__).resolve().parents[1] / "specdec_edge" / "data" / "spec_bench_question.jsonl"
QUESTIONS = (81, 241, 481)  # writing, summarization, rag: first turns


def prompts() -> list[str]:
    rows = {r["question_id"]: r for r in map(json.loads, DATA.read_text().splitlines())}
    return [rows[q]["turns"][0] for q in QUESTIONS]


def start_server(bundle: Path, method: str, threads: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-c", "from specdec_edge.cli import main; main()", "serve", str(bundle)]
    command += ["--method", method, "--threads", str(threads), "--port", str(port), "--no-history"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--method", default="pld")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    pipe = Pipeline.load(args.bundle, method=args.method, threads=args.threads, history=False)
    proc, url = start_server(args.bundle, args.method, args.threads)
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    rates: dict[str, list[float]] = {"pipeline": [], "server": [], "server-stream": []}
    first_text, same, total = [], 0, 0
    try:
        for _ in range(args.rounds):
            for prompt in prompts():
                messages = [{"role": "user", "content": prompt}]
                t = time.perf_counter()
                expected = pipe.generate(messages, max_new_tokens=args.max_tokens)
                rates["pipeline"].append(len(expected.token_ids) / (time.perf_counter() - t))
                t = time.perf_counter()
                r = client.chat.completions.create(
                    model=model, messages=messages, max_tokens=args.max_tokens, temperature=0
                )
                rates["server"].append(r.usage.completion_tokens / (time.perf_counter() - t))
                t, text, first = time.perf_counter(), "", None
                stream = client.chat.completions.create(
                    model=model, messages=messages, max_tokens=args.max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                )  # fmt: skip
                for chunk in stream:
                    for choice in chunk.choices:
                        if choice.delta.content and first is None:
                            first = time.perf_counter() - t
                        text += choice.delta.content or ""
                    if chunk.usage:
                        rates["server-stream"].append(chunk.usage.completion_tokens / (time.perf_counter() - t))
                first_text.append(first)
                same += (r.choices[0].message.content == expected.text) + (text == expected.text)
                total += 2
    finally:
        proc.terminate()
        proc.wait(15)
    base = statistics.median(rates["pipeline"])
    runs = f"{args.rounds} rounds x {len(QUESTIONS)} prompts, {args.max_tokens} tokens"
    print(f"{args.bundle.name}, {args.method}, {runs}")
    print("| path | tok/s (median) | vs pipeline |\n|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.1f} | {statistics.median(values) / base:.2f}x |")
    print(f"time to first streamed text: median {statistics.median(first_text) * 1000:.0f} ms")
    print(f"server answers equal to Pipeline.generate: {same} of {total}")


if __name__ == "__main__":
    main()
