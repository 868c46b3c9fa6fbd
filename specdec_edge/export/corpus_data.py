"""Training sequences from a corpus (``corpus.py``): its token ids with the features of the bundle the heads read.

Heads are trained on the features of the graph they will read at run time: the corpus's sequences are fed
through that bundle (teacher forcing, ``runtime.base.prefill`` on a ``FeatureTap``), so a gguf bundle gives the
features its quantized blocks and int8 activations compute, an fp32 bundle the float ones. Features are cached
per shard in ``folder`` (``features-NNNNN.npz``, keyed by the bundle and the shard's ids), so a rerun, or a
later session with more shards, computes only what is new.

Records held apart (``corpus.held_out``) are returned separately: the per-epoch check reads them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from specdec_edge.atomic import write_atomic
from specdec_edge.errors import ExportError
from specdec_edge.export.corpus import Corpus, held_out
from specdec_edge.export.draft_data import _read_part, _write_part

MAX_TOKENS = 1024  # of one sequence fed for features (request and answer); a part of each cache file's key


def _shard_features(tap, corpus: Corpus, shard: dict, max_tokens: int) -> list[tuple]:
    """(ids, features, answer start, layer features) per record of ``shard``."""
    from specdec_edge.runtime.base import prefill

    seqs = []
    for _, ids, answer in corpus.records(shard):
        ids = ids[: min(len(ids), max_tokens, tap.capacity) + 1]
        n = len(ids) - 1  # the last token is never fed
        prefill(tap, ids[:n].tolist())
        layers = None if tap.layer_features is None else tap.layer_features[:n].astype(np.float16)
        seqs.append((ids[:n].astype(np.int32), tap.features[:n].astype(np.float16), answer, layers))
    return seqs


def corpus_data(
    bundle: Path,
    corpus_dir: str | Path,
    folder: Path,
    *,
    layers: bool = False,
    held_out_every: int = 50,
    threads: int | None = None,
    progress: bool = True,
    shards: slice = slice(None),
) -> tuple[list[dict], list[dict]]:
    """(training sequences, held-out sequences) of every whole shard of the corpus in ``corpus_dir``.

    Each carries ``bundle``'s features (``draft_data``'s sequence dicts; held-out ones also carry their
    ``request``): one request in ``held_out_every`` is held out (``corpus.held_out``). ``shards``: which of them, by
    index: its stop keeps the first N (a training run resumed on a corpus that has grown since reads what it started
    with), its start skips the ones before (a run that continues earlier heads on new shards only)."""
    from tqdm import tqdm

    from specdec_edge.api.pipeline import Pipeline
    from specdec_edge.bundle.hashes import manifest_digest
    from specdec_edge.bundle.manifest import read_manifest
    from specdec_edge.speculative.features import FeatureTap

    corpus = Corpus.read(corpus_dir)
    stop, first = shards.stop, shards.start or 0
    if stop is not None and stop > len(corpus.shards):
        raise ExportError(f"the corpus in {corpus_dir} holds {len(corpus.shards)} shards, not {stop}; grow it first.")
    chosen = corpus.shards[:stop]
    if not 0 <= first < len(chosen):
        raise ExportError(
            f"--corpus-from {first} leaves no shard of the {len(chosen)} chosen from the corpus in {corpus_dir}; "
            f"pass a shard below {len(chosen)} (or grow the corpus first)."
        )
    chosen = chosen[first:]
    if read_manifest(bundle).target.graph.vocab_size != corpus.identity["vocab_size"]:
        raise ExportError(f"the corpus in {corpus_dir} was written with another vocabulary than bundle {bundle}'s.")
    folder.mkdir(parents=True, exist_ok=True)
    digest, pipe, train, apart = manifest_digest(bundle), None, [], []
    bar = tqdm(total=len(chosen), desc="corpus features", unit="shard", file=sys.stderr, disable=not progress)
    for shard in chosen:
        path = folder / f"features-{shard['shard']:05d}.npz"
        key = {"bundle": digest, "ids_sha256": shard["ids_sha256"], "max_tokens": MAX_TOKENS}
        meta = path.with_suffix(".json")
        if not (path.is_file() and meta.is_file() and json.loads(meta.read_text()) == key):
            # The target graph computes every feature, as its decode and verify passes do at run time: not a prefill
            # graph or OpenVINO, which `--prefill auto` may choose on this machine for prompts (another rounding).
            pipe = pipe or Pipeline.load(
                bundle, method="plain", threads=threads, history=False, prompt_cache_mb=0, prefill="onnxruntime"
            )
            seqs = _shard_features(FeatureTap(pipe.engines.target), corpus, shard, MAX_TOKENS)
            _write_part(path, seqs, pipe.engines.target.graph.hidden_size)
            write_atomic(meta, json.dumps(key))
        for seq, (request, _, _) in zip(_read_part(path, layers), corpus.records(shard)):
            if held_out(request, held_out_every):
                apart.append({**seq, "request": request})
            else:
                train.append(seq)
        bar.update()
    bar.close()
    if pipe is not None:
        pipe.close()
    if not train:
        raise ExportError(f"the corpus in {corpus_dir} holds no training sequence yet; grow it first.")
    return train, apart
