"""Fuzz of the bundle loader: truncated, bit-flipped and zeroed graph and tokenizer files, JSON-mangled
manifests, and manifest entries that lead outside the bundle. Each case ends in one clear one-line
``SpecdecError`` (a damaged file named) or, for a harmless change, a normal run; never another exception,
never a hang, and never a file opened outside the bundle (Python-level opens are watched by an audit hook;
ONNX Runtime and tokenizers only ever get paths that were checked first)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from specdec_edge import Pipeline, SpecdecError
from specdec_edge.cli import main

SEED = 1234
FILES = ("target/model.onnx", "target/model.onnx.data", "draft/model.onnx", "tokenizer.json")
VALUES = (None, -1, 0, 1, 3, 10**12, 2.5, float("nan"), True, "", "x", "../../etc/passwd", [], [1, "a"], {}, {"a": 1})

_OUTSIDE: list[str] = []  # realpaths whose opening is recorded
_OPENED: list[str] = []


def _audit(event, args):
    if event == "open" and _OUTSIDE and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if any(path == root or path.startswith(root + os.sep) for root in _OUTSIDE):
            _OPENED.append(path)


sys.addaudithook(_audit)  # inert unless a test sets _OUTSIDE


@pytest.fixture(scope="module")
def pristine(tiny_bundle, tmp_path_factory):
    """A copy of the tiny bundle, and beside it an "outside" folder with copies of its files (what a path
    traversal would read)."""
    base = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(tiny_bundle, base / "pristine")
    shutil.copytree(tiny_bundle, base / "outside")
    return base / "pristine"


@pytest.fixture
def watch_outside(pristine):
    outside = os.path.realpath(pristine.parent / "outside")
    _OUTSIDE.append(outside)
    _OPENED.clear()
    yield
    _OUTSIDE.remove(outside)
    assert not _OPENED, f"files outside the bundle were opened: {sorted(set(_OPENED))}"


def clone(pristine: Path, dest: Path, link: bool) -> Path:
    """A copy of the bundle. ``link`` is kept for the callers but copies too: hard links to the session's
    bundles would outlive this test, and ONNX's checker refuses external data with several links (a
    hard-link attack guard), which broke later tests that export from those bundles."""
    dest.mkdir()
    for src in pristine.rglob("*"):
        out = dest / src.relative_to(pristine)
        if src.is_dir():
            out.mkdir(exist_ok=True)
        else:
            shutil.copy2(src, out)
    return dest


def attempt(bundle: Path, method: str | None = None) -> str | None:
    """Load, generate a few tokens, close; the one-line error message, or None when it all worked. Any other
    exception fails the test; so does a call that does not return within a minute."""
    outcome: list = []

    def run():
        try:
            with Pipeline.load(bundle, method=method, threads=1) as pipe:
                pipe.generate("The quick", max_new_tokens=4)
            outcome.append(None)
        except SpecdecError as e:
            outcome.append(str(e))
        except BaseException as e:  # reported below with the case
            outcome.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), f"loading {bundle} hung"
    (result,) = outcome
    if isinstance(result, BaseException):
        raise AssertionError(f"{bundle}: {type(result).__name__}: {result}") from result
    assert result is None or (result and "\n" not in result), f"not one line: {result!r}"
    return result


def cli(*args) -> tuple[int, str]:
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), f"{args}: {res.exception!r}"
    assert "Traceback" not in res.output, res.output
    return res.exit_code, res.output


def rehash(bundle: Path, rel: str) -> None:
    """Record a file's new size and sha256 in the manifest: a damaged but consistent bundle."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    data = (bundle / rel).read_bytes()
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (bundle / "manifest.json").write_text(json.dumps(manifest))


def damage(path: Path, how: str, rng: random.Random) -> str:
    raw = bytearray(path.read_bytes())
    if how == "truncate":
        cut = rng.randrange(len(raw))
        path.write_bytes(bytes(raw[:cut]))
        return f"truncated to {cut} bytes"
    if how == "bitflip":
        at = rng.randrange(len(raw))
        raw[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw))
        return f"bit flipped at byte {at}"
    start = rng.randrange(len(raw))
    end = min(len(raw), start + rng.randrange(1, 4096))
    raw[start:end] = bytes(end - start)
    path.write_bytes(bytes(raw))
    return f"bytes {start}..{end} zeroed"


@pytest.mark.parametrize("rel", FILES)
def test_damaged_files_are_named(pristine, tmp_path, rel, watch_outside):
    rng = random.Random(f"{SEED}{rel}")
    for n, how in enumerate(("truncate", "bitflip", "zero", "bitflip")):
        bundle = clone(pristine, tmp_path / f"b{n}", link=False)
        what = damage(bundle / rel, how, rng)
        error = attempt(bundle)
        assert error and rel in error and ("verify" in error or "size" in error), f"{rel} {what}: {error}"
        code, out = cli("verify", bundle)
        assert code == 1 and rel in out, f"{rel} {what}: verify said {out!r}"
        code, out = cli("info", bundle)
        assert code == 2 and rel in out, f"{rel} {what}: info said {out!r}"


@pytest.mark.parametrize("rel", ("target/model.onnx", "draft/model.onnx", "tokenizer.json"))
def test_damaged_files_with_a_matching_manifest_fail_clearly(pristine, tmp_path, rel, watch_outside):
    """The manifest rewritten to match the damage (sizes and hashes pass): what reads the file must fail with
    the file named, or the bundle must run (a flipped weight bit can be harmless)."""
    rng = random.Random(f"{SEED}{rel}consistent")
    errors = 0
    for n, how in enumerate(("truncate", "zero", "truncate", "bitflip", "zero")):
        bundle = clone(pristine, tmp_path / f"b{n}", link=False)
        what = damage(bundle / rel, how, rng)
        rehash(bundle, rel)
        error = attempt(bundle)
        if error is not None:
            errors += 1
            assert Path(rel).name in error and ("verify" in error or "re-export" in error), f"{rel} {what}: {error}"
    assert errors >= 2  # truncated protobufs and JSON cannot load


def mangle(data, rng: random.Random) -> tuple[object, str]:
    """One random change somewhere in a JSON tree: a key removed, a value replaced by one of another type."""
    data = copy.deepcopy(data)
    node, where = data, "$"
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        key = rng.choice(keys)
        child = node[key]
        if not isinstance(child, (dict, list)) or not child or rng.random() < 0.3:
            if isinstance(node, dict) and rng.random() < 0.25:
                del node[key]
                return data, f"{where}.{key} removed"
            value = rng.choice(VALUES)
            node[key] = value
            return data, f"{where}.{key} = {value!r}"
        node, where = child, f"{where}.{key}"
    return data, "unchanged"


def leaves(data, where=()):
    """Paths of the scalar values in a JSON tree (lists of many entries, such as the graph's input list,
    contribute their first entry only)."""
    items = data.items() if isinstance(data, dict) else list(enumerate(data))[:1]
    for key, value in items:
        if isinstance(value, (dict, list)) and value:
            yield from leaves(value, (*where, key))
        else:
            yield (*where, key)


def test_mangled_manifests_fail_clearly_or_run(pristine, tmp_path, watch_outside):
    rng = random.Random(SEED)
    original = json.loads((pristine / "manifest.json").read_text())
    text = (pristine / "manifest.json").read_bytes()
    paths = [p for p in leaves(original) if "validation" not in p]  # validation numbers are only reported
    cases = [("leaf", p) for p in rng.sample(paths, min(40, len(paths)))]
    cases += [("random", None)] * 16 + [("cut", None)] * 6 + [("flip", None)] * 6
    outcomes = {"error": 0, "ran": 0}
    for n, (kind, path) in enumerate(cases):
        bundle = clone(pristine, tmp_path / f"m{n}", link=True)
        if kind == "cut":  # the text itself cut short
            cut = rng.randrange(len(text))
            (bundle / "manifest.json").write_bytes(text[:cut])
            what = f"manifest cut at byte {cut}"
        elif kind == "flip":  # a byte flipped (invalid JSON, invalid UTF-8, or another value)
            raw = bytearray(text)
            at = rng.randrange(len(raw))
            raw[at] ^= 1 << rng.randrange(8)
            (bundle / "manifest.json").write_bytes(bytes(raw))
            what = f"manifest byte {at} flipped"
        else:
            if kind == "leaf":  # every scalar of the contract, the tokenizer and the file list in turn
                data, value = copy.deepcopy(original), rng.choice(VALUES)
                node = data
                for key in path[:-1]:
                    node = node[key]
                node[path[-1]] = value
                what = f"{'.'.join(map(str, path))} = {value!r}"
            else:
                data, what = mangle(original, rng)
            (bundle / "manifest.json").write_text(json.dumps(data))
        error = attempt(bundle)
        outcomes["ran" if error is None else "error"] += 1
        for command in ("info", "verify"):
            code, out = cli(command, bundle)
            assert code in (0, 1, 2), f"{what}: {command} exited {code}: {out}"
    assert outcomes["error"] >= len(cases) // 2, outcomes  # most changes break the contract and are refused


def write_manifest(bundle: Path, change) -> None:
    data = json.loads((bundle / "manifest.json").read_text())
    change(data)
    (bundle / "manifest.json").write_text(json.dumps(data))


def outside_entries(data: dict, rel: str, path: str) -> None:
    """Point the entry ``rel`` of the file list (and whatever refers to it) at ``path``."""
    entry = data["files"].pop(rel)
    data["files"][path] = entry
    if rel == "tokenizer.json":
        data["tokenizer"]["file"] = path
    for role in ("target", "draft"):
        if data[role]["graph"]["path"] == rel:
            data[role]["graph"]["path"] = path


def test_paths_outside_the_bundle_are_refused(pristine, tmp_path, watch_outside):
    outside = pristine.parent / "outside"
    cases = {
        "parent": lambda d: outside_entries(d, "tokenizer.json", "../outside/tokenizer.json"),
        "deep parent": lambda d: outside_entries(d, "target/model.onnx", "target/../../outside/target/model.onnx"),
        "absolute": lambda d: outside_entries(d, "draft/model.onnx", str(outside / "draft/model.onnx")),
        "backslash": lambda d: outside_entries(d, "tokenizer.json", "..\\outside\\tokenizer.json"),
        "drive": lambda d: outside_entries(d, "tokenizer.json", "C:/outside/tokenizer.json"),
        "extra file": lambda d: d["files"].update({"../outside/tokenizer.json": d["files"]["tokenizer.json"]}),
        "head graph": lambda d: d.update(
            heads={"eagle": {"graph": "../outside/target/model.onnx", "top_k": 4, "config": {}}}
        ),
        "engine": lambda d: d.update(engines=[{"file": "/etc/passwd", "role": "target", "kind": "trt"}]),
    }
    for n, (name, change) in enumerate(cases.items()):
        bundle = clone(pristine, tmp_path / f"t{n}", link=True)
        write_manifest(bundle, change)
        error = attempt(bundle)
        assert error and ("outside the bundle" in error or "not a relative file path" in error), f"{name}: {error}"
        for command in ("info", "verify"):
            assert cli(command, bundle)[0] == 2, f"{name}: {command}"
    # A symbolic link inside the bundle that points outside it.
    bundle = clone(pristine, tmp_path / "link", link=True)
    (bundle / "target/model.onnx.data").unlink()
    (bundle / "target/model.onnx.data").symlink_to(outside / "target/model.onnx.data")
    error = attempt(bundle)
    assert error and "links to" in error and "outside the bundle" in error
    assert cli("verify", bundle)[0] == 2


def test_mangled_head_sections_fail_clearly_or_run(heads_bundle, tmp_path):
    """Every value of the trained heads' manifest sections (EAGLE and Medusa) in turn."""
    rng = random.Random(SEED + 1)
    original = json.loads((heads_bundle / "manifest.json").read_text())
    paths = [p for p in leaves(original["heads"], ("heads",)) if not {"training", "validation"} & set(p)]
    assert len(paths) > 10
    errors = 0
    for n, path in enumerate(paths):
        data, value = copy.deepcopy(original), rng.choice(VALUES)
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        bundle = clone(heads_bundle, tmp_path / f"h{n}", link=True)
        (bundle / "manifest.json").write_text(json.dumps(data))
        for method in ("eagle", "medusa"):
            errors += attempt(bundle, method) is not None
    assert errors >= len(paths) // 2


def test_a_damaged_head_graph_and_missing_files_are_named(heads_bundle, tmp_path):
    bundle = clone(heads_bundle, tmp_path / "heads", link=False)
    eagle = json.loads((bundle / "manifest.json").read_text())["heads"]["eagle"]["graph"]  # beside the target's table
    raw = bytearray((bundle / eagle).read_bytes())
    raw[len(raw) // 3] ^= 0x10  # one flipped bit: ONNX Runtime would load and run it silently
    (bundle / eagle).write_bytes(bytes(raw))
    error = attempt(bundle)
    assert error and eagle in error and "specdec-edge verify" in error
    code, out = cli("verify", bundle)
    assert code == 1 and f"MISMATCH {eagle}" in out
    (bundle / "heads/medusa.onnx").unlink()
    (bundle / "tokenizer.json").write_text("{}")
    code, out = cli("verify", bundle)  # exit 1 (not 2) for a missing or wrong-size file, as documented
    assert code == 1 and "heads/medusa.onnx (missing)" in out and "tokenizer.json (size 2, manifest says" in out


def relocate_weights(bundle: Path, new_name: str) -> None:
    """The target graph's initializers moved to ``new_name``: the graph rewritten to point there, the manifest
    listing the new graph but not the weights file (ONNX lets a graph name any file of its folder)."""
    import onnx

    graph = bundle / "target" / "model.onnx"
    (bundle / "target" / "model.onnx.data").rename(bundle / "target" / new_name)
    model = onnx.load(str(graph), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = new_name
    graph.write_bytes(model.SerializeToString())
    manifest = json.loads((bundle / "manifest.json").read_text())
    del manifest["files"]["target/model.onnx.data"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    rehash(bundle, "target/model.onnx")


def test_weights_in_a_file_the_manifest_does_not_list_are_refused(pristine, tmp_path):
    from specdec_edge.bundle.graph_refs import external_data_files

    assert external_data_files(pristine / "target" / "model.onnx") == {"model.onnx.data"}
    bundle = clone(pristine, tmp_path / "unlisted", link=False)
    relocate_weights(bundle, "weights.bin")
    damage(bundle / "target" / "weights.bin", "bitflip", random.Random(SEED))  # unchecked, it would load
    error = attempt(bundle)
    assert error and "weights.bin" in error and "does not list" in error, error
    code, out = cli("info", bundle)
    assert code == 2 and "weights.bin" in out
    # Listed (and so hashed), a file damaged after its listing is named as damaged.
    rehash(bundle, "target/weights.bin")
    raw = bytearray((bundle / "target" / "weights.bin").read_bytes())
    raw[0] ^= 0xFF
    (bundle / "target" / "weights.bin").write_bytes(bytes(raw))
    assert "does not match its sha256" in attempt(bundle)


def test_a_change_in_place_that_restores_the_mtime_is_hashed_again(pristine, tmp_path, monkeypatch):
    """rsync --inplace -t, cp -p onto an existing file, tar: same size, inode and mtime, other bytes."""
    from specdec_edge.bundle.hashes import HashRecord, check_hashes
    from specdec_edge.bundle.manifest import read_manifest

    monkeypatch.setattr(HashRecord, "RACY_S", 0.0)  # record files changed just now, as if 2 s had passed
    bundle = clone(pristine, tmp_path / "inplace", link=False)
    data = bundle / "target" / "model.onnx.data"
    check_hashes(bundle, read_manifest(bundle))
    assert HashRecord().vouches(data, read_manifest(bundle).files["target/model.onnx.data"]["sha256"])
    before = data.stat()
    with open(data, "r+b") as f:  # the same inode, the same size
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))  # the mtime put back
    after = data.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    error = attempt(bundle)
    assert error and "model.onnx.data" in error and "sha256" in error, error


def break_tokenizer(bundle: Path) -> None:
    """A tokenizer.json whose pre-tokenizer regex backtracks: the Rust library panics on a long run of a's
    (a PanicException, a BaseException that passes ``except Exception``)."""
    spec = json.loads((bundle / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False}
    (bundle / "tokenizer.json").write_text(json.dumps(spec))
    rehash(bundle, "tokenizer.json")


def test_a_tokenizer_that_panics_is_a_clear_error(pristine, tmp_path):
    bundle = clone(pristine, tmp_path / "panics", link=False)
    break_tokenizer(bundle)
    with Pipeline.load(bundle, method="plain", threads=1) as pipe:
        assert pipe.generate("The quick", max_new_tokens=2).token_ids  # the regex is harmless here
        for prompt in ("a" * 60 + "b", [{"role": "user", "content": "a" * 60 + "b"}]):
            with pytest.raises(SpecdecError, match="tokenizer .* failed to encode") as e:
                pipe.generate(prompt, max_new_tokens=2)
            assert "\n" not in str(e.value) and "PanicException" in str(e.value)
        assert pipe.generate("The quick", max_new_tokens=2).token_ids  # and it goes on working
    code, out = cli("generate", bundle, "--prompt", "a" * 60 + "b", "--threads", "1", "--max-new-tokens", "2")
    assert code == 2 and "failed to encode" in out


def test_a_kv_cache_larger_than_memory_is_refused_before_allocating(pristine, tmp_path):
    """A graph whose cache dimension is symbolic, with a manifest capacity of 1e12 tokens (466 TiB)."""
    import onnx

    from specdec_edge.runtime.base import physical_memory

    bundle = clone(pristine, tmp_path / "huge", link=False)
    graph = bundle / "target" / "model.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    for value in [*model.graph.input, *model.graph.output]:
        if value.name.startswith(("past_key_values.", "present.")):
            value.type.tensor_type.shape.dim[2].dim_param = "capacity"
    graph.write_bytes(model.SerializeToString())
    rehash(bundle, "target/model.onnx")
    write_manifest(bundle, lambda d: d["target"]["graph"]["cache"].update(capacity=10**12))
    error = attempt(bundle, method="plain")
    assert error and "memory" in error and "--capacity" in error, error
    assert physical_memory() and f"needs {512 * 10**12 / 2**30:.1f} GiB" in error  # 2 layers x K, V x 2 x 16 x 4 B
