"""A training corpus that accumulates: self-written requests and the target's greedy answers, in shards.

The chat model writes a user request from the start of its chat template's user turn (sampled, the "Magpie"
idea, ``self_data.py``), then answers it greedily; both come from our own runtime on the bundle the heads will
serve (``auto``: exact, so the answers are the bundle's own greedy tokens). Work is written in shards, each
committed by an atomic rename, so a run stopped at any moment loses at most the shard it was writing and a
rerun continues after the last whole shard, in any session, on any machine::

    corpus/smollm2/
      shard-00000.ids    token ids of every record, back to back (uint16, or uint32 for vocabularies > 65,536)
      shard-00000.json   the shard's manifest: who wrote it and how, the records' offsets, counts, sha256 of .ids

A record is the whole sequence the bundle saw: the prompt as the chat template encodes it, then the answer
(its end-of-turn token included when it ended by itself): ``ids[start:answer]`` and ``ids[answer:end]``.
Shard ``i``'s sampling seeds derive from the corpus seed and ``i``, so what a shard holds does not depend on
when it was written. A shard written with other settings or by another model ("foreign"), or whose ids do
not match their recorded sha256 ("damaged"), is refused by name; the fix is in the message.

The runtime side only (numpy + ONNX Runtime): it runs on any machine that can run the bundle.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specdec_edge.api.settings import LoadSettings
from specdec_edge.atomic import write_atomic
from specdec_edge.errors import ExportError
from specdec_edge.export import openers

FORMAT = "specdec-edge-corpus/1"
SENTINEL = "\u2063specdec-edge-user-request\u2063"  # never produced by a model: marks where the request starts
SPEC_BENCH = Path(__file__).resolve().parent.parent / "data" / "spec_bench_question.jsonl"
_MARKUP = re.compile(r"<\|[^|>]*\|>|<start_of_turn>|<end_of_turn>")
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class CorpusSettings:
    """How requests are written and answered; every shard of a corpus records them, and all must agree."""

    seed: int = 0
    per_shard: int = 64  # requests per shard: what an interrupted run loses at most
    method: str = "auto"  # answers are greedy, so any exact method gives the same tokens; auto is the fastest
    answer_tokens: int = 160  # covers the 128 new tokens a bench call asks for, with room
    request_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 0.98
    min_words: int = 3
    max_words: int = 120
    openers: str = ""  # "": the model writes the whole request; "tasks": it completes a task opener (openers.py)


LATE_FIELDS = {"openers": ""}  # settings added after shards were written: absent from a shard means this value


def stored_settings(settings: dict) -> dict:
    """Settings as a shard stores them: a late field at its old value left out, so older shards still agree."""
    return {k: v for k, v in settings.items() if not (k in LATE_FIELDS and v == LATE_FIELDS[k])}


@dataclass
class ShardReport:
    """What one shard took: kept requests, why the other samples were dropped, tokens and seconds."""

    kept: int = 0
    sampled: int = 0
    dropped: Counter = field(default_factory=Counter)
    request_tokens: int = 0
    answer_tokens: int = 0
    seconds: float = 0.0


def model_identity(root: Path, manifest) -> dict:
    """Which model's answers a corpus holds: the source model (its file or hub name, not where this machine
    keeps it), the weights' dtype and the tokenizer's bytes. Not the graph's bytes: an exporter that changes how
    the same weights are computed (another padding, another fused op) still writes the same model's answers, and
    the corpus must outlive such changes. Each shard records the bytes that wrote it (``graph_digest``)."""
    tokenizer = manifest.files.get(manifest.tokenizer.file)
    tokenizer_sha = tokenizer["sha256"] if isinstance(tokenizer, dict) else str(tokenizer)
    return {
        "source": Path(manifest.target.source).name,
        "dtype": manifest.target.graph.dtype,
        "vocab_size": manifest.target.graph.vocab_size,
        "tokenizer_sha256": tokenizer_sha,
    }


def graph_digest(manifest) -> str:
    """The sha256 of the target graph's and tokenizer's files as the manifest records them: which exported
    bytes wrote a shard (provenance; the corpus's identity is the model's, ``model_identity``)."""
    graph_dir = str(Path(manifest.target.graph.path).parent)
    keep = sorted(
        (name, rec["sha256"] if isinstance(rec, dict) else str(rec))
        for name, rec in manifest.files.items()
        if name == manifest.tokenizer.file or name.startswith(graph_dir + "/") or name == manifest.target.graph.path
    )
    return hashlib.sha256(json.dumps(keep).encode()).hexdigest()


class Corpus:
    """The shards in one folder: checked when opened, appended to by ``add_shard``."""

    def __init__(self, folder: str | Path, identity: dict, settings: CorpusSettings, bundle: str | None = None):
        self.folder = Path(folder)
        self.identity, self.settings = identity, settings
        self.bundle = bundle  # the writing bundle's ``graph_digest``; None when only reading
        self.dtype = np.uint16 if identity["vocab_size"] <= 65536 else np.uint32
        self.folder.mkdir(parents=True, exist_ok=True)
        self.shards: list[dict] = []
        for path in sorted(self.folder.glob("shard-*.json")):
            self.shards.append(self._check(path))
        for i, shard in enumerate(self.shards):
            if shard["shard"] != i:
                raise ExportError(f"{self.folder}: shard {i} is missing (the next is {shard['shard']}); restore it.")

    def _check(self, path: Path) -> dict:
        """A shard's manifest, refused by name if it is damaged or was written with other settings or model."""
        fix = f"delete {path.with_suffix('.*')} to write it again, or use another corpus folder"
        try:
            shard = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ExportError(f"corpus shard {path} is damaged ({e}); {fix}.") from None
        if shard.get("format") != FORMAT:
            raise ExportError(f"corpus shard {path} is not a {FORMAT} shard; {fix}.")
        theirs, mine = stored_settings(shard.get("settings") or {}), stored_settings(asdict(self.settings))
        if shard.get("identity") != self.identity or theirs != mine:
            raise ExportError(
                f"corpus shard {path} is foreign: written by another model or with other settings "
                f"({_difference(shard, self.identity, asdict(self.settings))}); {fix}."
            )
        ids_path = path.with_suffix(".ids")
        if not ids_path.is_file() or hashlib.sha256(ids_path.read_bytes()).hexdigest() != shard.get("ids_sha256"):
            raise ExportError(f"corpus shard {ids_path} is damaged (missing, or not what its manifest records); {fix}.")
        return shard

    def drop_unfinished(self) -> None:
        """Delete ids whose manifest was never written (a shard interrupted while being written)."""
        for stale in self.folder.glob("shard-*.ids"):
            if not stale.with_suffix(".json").is_file():
                stale.unlink()

    @classmethod
    def read(cls, folder: str | Path) -> Corpus:
        """An existing corpus for reading, whatever wrote it (its shards must agree with each other)."""
        first = Path(folder) / "shard-00000.json"
        if not first.is_file():
            raise ExportError(f"{folder} holds no corpus (no shard-00000.json); write one with `specdec-edge corpus`.")
        try:
            shard = json.loads(first.read_text(encoding="utf-8"))
            identity, settings = shard["identity"], CorpusSettings(**shard["settings"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ExportError(f"corpus shard {first} is damaged ({e}); delete it or restore it.") from None
        return cls(folder, identity, settings)

    @property
    def requests(self) -> list[str]:
        return [r["request"] for s in self.shards for r in s["records"]]

    @property
    def answer_tokens(self) -> int:
        return sum(s["counts"]["answer_tokens"] for s in self.shards)

    def add_shard(self, records: list[dict], ids: list[int], report: ShardReport) -> Path:
        """Write the next shard: its ids, then its manifest (the commit point: a shard without one is not there)."""
        index = len(self.shards)
        stem = self.folder / f"shard-{index:05d}"
        data = np.asarray(ids, dtype=self.dtype).tobytes()
        write_atomic(stem.with_suffix(".ids"), data)
        shard = {
            "format": FORMAT,
            "shard": index,
            "identity": self.identity,
            "graph_digest": self.bundle,
            "settings": stored_settings(asdict(self.settings)),
            "seed": shard_seed(self.settings.seed, index),
            "ids_dtype": np.dtype(self.dtype).name,
            "ids_sha256": hashlib.sha256(data).hexdigest(),
            "records": records,
            "counts": {
                "requests": report.kept,
                "sampled": report.sampled,
                "dropped": dict(report.dropped),
                "request_tokens": report.request_tokens,
                "answer_tokens": report.answer_tokens,
                "seconds": round(report.seconds, 1),
            },
            "machine": {"cpu": _cpu_name(), "python": platform.python_version()},
        }
        write_atomic(stem.with_suffix(".json"), json.dumps(shard, indent=1, ensure_ascii=False) + "\n")
        self.shards.append(shard)
        return stem

    def records(self, shard: dict):
        """A shard's records as (request, ids int64 [T], answer start): the whole sequence, where the answer begins."""
        ids = np.fromfile(self.folder / f"shard-{shard['shard']:05d}.ids", dtype=shard["ids_dtype"])
        for r in shard["records"]:
            yield r["request"], ids[r["start"] : r["end"]].astype(np.int64), r["answer"] - r["start"]


def held_out(request: str, every: int = 50) -> bool:
    """Whether a request is kept apart from training (one in ``every``, by a hash of its text: the same on
    every machine and for every later shard)."""
    return int(hashlib.sha256(request.encode("utf-8")).hexdigest()[:8], 16) % every == 0


def shard_seed(seed: int, index: int) -> int:
    """Shard ``index``'s first sampling seed: independent of when, or after which other shards, it is written."""
    return (seed * 1_000_003 + index) * 10_000


def _difference(shard: dict, identity: dict, settings: dict) -> str:
    if shard.get("identity") != identity:
        theirs = shard.get("identity") or {}
        differ = [f"{k} {theirs.get(k)!r} vs this bundle's {v!r}" for k, v in identity.items() if theirs.get(k) != v]
        return "; ".join(differ)
    theirs = {**LATE_FIELDS, **(shard.get("settings") or {})}
    return ", ".join(f"{k}={theirs.get(k)!r} vs {v!r}" for k, v in settings.items() if theirs.get(k) != v)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def word_grams(text: str, n: int = 4) -> set[tuple]:
    words = _WORD.findall(text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


class NearDuplicates:
    """Requests to keep out of a corpus: those that share most of their word 4-grams with a benchmark prompt
    (Spec-Bench's by default), or that repeat an earlier request once case and spacing are ignored."""

    def __init__(self, benchmark: Path = SPEC_BENCH, share: float = 0.5):
        self.grams: set[tuple] = set()
        self.texts: set[str] = set()
        for line in benchmark.read_text(encoding="utf-8").splitlines():
            if line.strip():
                for turn in json.loads(line)["turns"]:
                    self.grams |= word_grams(turn)
                    self.texts.add(_key(turn))
        self.share, self.seen = share, set()

    def reason(self, text: str) -> str | None:
        key = _key(text)
        if key in self.seen:
            return "duplicate"
        grams = word_grams(text)
        if key in self.texts or (grams and len(grams & self.grams) >= self.share * len(grams)):
            return "benchmark"
        return None

    def add(self, text: str) -> None:
        self.seen.add(_key(text))


def _key(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


def drop_reason(text: str, ids: list[int], settings: CorpusSettings) -> str | None:
    """Why a sampled request is not kept (None: keep it): too short or long, template markup, undecodable or
    mostly symbols, or a loop (fewer than 60 % distinct token 4-grams)."""
    words = text.split()
    if len(words) < settings.min_words:
        return "short"
    if len(words) > settings.max_words:
        return "long"
    if _MARKUP.search(text):
        return "markup"
    if "\ufffd" in text or any(ord(c) < 32 and c not in "\n\t" for c in text):
        return "undecodable"
    if sum(c.isalpha() for c in text) < 0.5 * len(text.replace(" ", "")):
        return "symbols"
    if distinct_4grams(ids) < 0.6:
        return "repetitive"
    return None


def distinct_4grams(items) -> float:
    """The share of distinct 4-grams among all 4-grams of ``items`` (token ids or words; 1.0: none repeats, or the
    sequence is shorter than 4): below ~0.6 for a greedy loop."""
    grams = [tuple(items[i : i + 4]) for i in range(len(items) - 3)]
    return len(set(grams)) / len(grams) if grams else 1.0


def user_turn_prefix(tokenizer) -> str:
    """The chat template's text up to where a user's request begins (its system turn included, if it adds one).
    A base model without a chat template cannot write requests."""
    if not tokenizer.has_chat_template:
        raise ExportError("the bundle has no chat template (a base model), so it cannot write its own requests.")
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], add_generation_prompt=False)
    if SENTINEL not in text:
        raise ExportError("the bundle's chat template drops the user's message, so it cannot write requests.")
    return text[: text.index(SENTINEL)]


def write_shard(pipe, corpus: Corpus, filters: NearDuplicates) -> tuple[Path, ShardReport]:
    """Write and answer the next shard's requests with ``pipe`` (a ``Pipeline`` over the corpus's bundle)."""
    s, index = corpus.settings, len(corpus.shards)
    prefix, eos = user_turn_prefix(pipe.tokenizer), sorted(pipe.tokenizer.eos_token_ids)
    report, records, ids, seed = ShardReport(), [], [], shard_seed(s.seed, index)
    start = time.perf_counter()
    while report.kept < s.per_shard:
        if report.sampled >= 20 * s.per_shard:
            raise ExportError(f"the model wrote no usable request in {report.sampled} tries ({dict(report.dropped)}).")
        start_words = openers.opener(s.openers, seed + report.sampled)
        sample = pipe.generate(
            prefix + start_words, s.request_tokens, temperature=s.temperature, top_p=s.top_p,
            seed=seed + report.sampled, history=False,
        )  # fmt: skip
        report.sampled += 1
        if sample.finish_reason != "eos":
            report.dropped["unfinished"] += 1
            continue
        text = (start_words + sample.text).strip()
        reason = drop_reason(text, sample.token_ids, s) or filters.reason(text)
        if reason:
            report.dropped[reason] += 1
            continue
        filters.add(text)
        messages = [{"role": "user", "content": text}]
        prompt = pipe.encode(messages)
        answer = pipe.generate(messages, s.answer_tokens, history=False)
        tail = [eos[0]] if answer.finish_reason == "eos" and eos else []
        records.append(
            {"request": text, "start": len(ids), "answer": len(ids) + len(prompt),
             "end": len(ids) + len(prompt) + len(answer.token_ids) + len(tail), "finish": answer.finish_reason}
        )  # fmt: skip
        ids += prompt + answer.token_ids + tail
        report.kept += 1
        report.request_tokens += len(prompt)
        report.answer_tokens += len(answer.token_ids) + len(tail)
    report.seconds = time.perf_counter() - start
    return corpus.add_shard(records, ids, report), report


def grow(bundle: str | Path, folder: str | Path, settings: CorpusSettings, *, answer_tokens_goal: int,
         max_minutes: float | None = None, max_shards: int | None = None, load: LoadSettings | None = None,
         log=print) -> Corpus:  # fmt: skip
    """Append shards to the corpus in ``folder`` until it holds ``answer_tokens_goal`` answer tokens (or
    ``max_minutes`` pass, or ``max_shards`` more were written); a rerun continues after the last whole shard.
    ``load``: how the runtime loads the bundle (threads; ``spinning``: pools that spin between ops, fastest alone, or
    sleep, for a job in the background of other work)."""
    from specdec_edge.api.pipeline import Pipeline
    from specdec_edge.bundle.manifest import read_manifest

    root = Path(bundle)
    manifest = read_manifest(root)
    corpus = Corpus(folder, model_identity(root, manifest), settings, bundle=graph_digest(manifest))
    corpus.drop_unfinished()
    filters = NearDuplicates()
    for text in corpus.requests:
        filters.add(text)
    log(f"corpus {corpus.folder}: {len(corpus.shards)} shards, {len(corpus.requests)} requests, "
        f"{corpus.answer_tokens} answer tokens; goal {answer_tokens_goal}")  # fmt: skip
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    with Pipeline.load(root, load or LoadSettings(), method=settings.method) as pipe:
        last = None if max_shards is None else len(corpus.shards) + max_shards
        while corpus.answer_tokens < answer_tokens_goal and (deadline is None or time.monotonic() < deadline):
            if last is not None and len(corpus.shards) >= last:
                break
            stem, r = write_shard(pipe, corpus, filters)
            log(f"{stem.name}: {r.kept} requests ({r.sampled} sampled, dropped {dict(r.dropped)}), "
                f"{r.answer_tokens} answer tokens in {r.seconds:.0f} s "
                f"({(r.answer_tokens + r.request_tokens) / max(r.seconds, 1e-9):.0f} tok/s); "
                f"corpus: {corpus.answer_tokens} answer tokens, {len(corpus.requests)} requests")  # fmt: skip
    return corpus


TOPICS = {  # keyword buckets for the report's topic spread (first match wins; the rest is "other")
    "coding": ("code", "python", "javascript", "function", "program", "sql", "java", "script", "api", "algorithm"),
    "math": ("calculate", "equation", "math", "solve", "number", "sum", "probability", "percent", "formula"),
    "writing": ("write", "story", "poem", "essay", "letter", "article", "blog", "email", "rewrite", "summarize"),
    "science": ("science", "physics", "chemistry", "biology", "energy", "climate", "planet", "cell", "atom"),
    "health": ("health", "anxiety", "stress", "diet", "exercise", "sleep", "medical", "doctor", "mental"),
    "business": ("business", "marketing", "company", "customer", "market", "finance", "money", "invest", "job"),
    "history": ("history", "war", "ancient", "century", "empire", "culture", "art", "philosophy", "religion"),
    "advice": ("how can i", "how do i", "tips", "advice", "help me", "should i", "recommend", "suggest"),
    "explain": ("explain", "what is", "what are", "why", "describe", "difference"),
}


def topic(request: str) -> str:
    text = request.lower()
    words = set(_WORD.findall(text))
    for name, keys in TOPICS.items():
        if any((k in text) if " " in k else (k in words) for k in keys):
            return name
    return "other"


def report(corpus: Corpus) -> dict:
    """What the corpus holds: counts, the spread of request lengths and topics, answer lengths, who wrote it."""
    requests = corpus.requests
    words = [len(r.split()) for r in requests] or [0]
    answers = [r["end"] - r["answer"] for s in corpus.shards for r in s["records"]] or [0]
    finishes = Counter(r["finish"] for s in corpus.shards for r in s["records"])
    return {
        "shards": len(corpus.shards),
        "requests": len(requests),
        "distinct_requests": len({_key(r) for r in requests}),
        "held_out_requests": sum(held_out(r) for r in requests),
        "answer_tokens": corpus.answer_tokens,
        "request_words_p10_p50_p90": [float(np.percentile(words, q)) for q in (10, 50, 90)],
        "answer_tokens_p10_p50_p90": [float(np.percentile(answers, q)) for q in (10, 50, 90)],
        "answers_ended_by_the_model": round(finishes.get("eos", 0) / max(len(requests), 1), 3),
        "openers": corpus.settings.openers or "none (the model writes the whole request)",
        "topics": dict(Counter(topic(r) for r in requests).most_common()),
        "machines": dict(Counter(s["machine"]["cpu"] for s in corpus.shards)),
        "seconds": round(sum(s["counts"]["seconds"] for s in corpus.shards)),
    }


def ngram_table(corpus: Corpus, min_count: int = 2, every: int = 50, shards: int | None = None):
    """The n-gram table (``speculative/table.py``) of the corpus's training answers (held-out ones left out), of its
    first ``shards`` shards (None: all)."""
    from specdec_edge.speculative.table import NgramTable

    answers = (
        ids[answer:]
        for s in corpus.shards[:shards]
        for request, ids, answer in corpus.records(s)
        if not held_out(request, every)
    )
    return NgramTable.build(answers, corpus.identity["vocab_size"], min_count)


def save_table(table, path: str | Path) -> Path:
    """Write ``table`` to ``path`` atomically."""
    write_atomic(Path(path), write=table.save, suffix=".tmp.npz")
    return Path(path)
