"""Disks that are full or read-only, writers that race, and work folders from elsewhere: export onto a full or
read-only file system (a real tmpfs, mounted here), bench --json onto a full one, staging folders left by
killed exports, two exports onto one --out, a pickle planted as a train-draft checkpoint, and the default
KV cache capacity of a model with fewer positions than 2048."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from specdec_edge import SpecdecError
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.bundle.schema import SCHEMA_VERSION
from specdec_edge.bundle.write import StagingDir, remove_stale_staging
from specdec_edge.cli import main


def run(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), f"{args}: {res.exception!r}"
    assert "Traceback" not in res.output, res.output
    return res


def error_lines(res) -> list[str]:
    return [line for line in res.output.splitlines() if line.startswith("Error")]


@contextlib.contextmanager
def tmpfs(tmp_path: Path, size: str, *, read_only: bool = False, fill: bool = False):
    """A real small file system at a fresh folder: ``size`` bytes, read-only or filled to the last byte."""
    where = tmp_path / f"fs-{uuid.uuid4().hex[:8]}"
    where.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mount.stderr.decode().strip()}")
    try:
        if fill:
            with open(where / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
                while f.write(b"\0" * 4096):
                    pass
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_export_onto_a_read_only_file_system_is_refused_before_the_load(tiny_llama_dir, tmp_path):
    with tmpfs(tmp_path, "1m", read_only=True) as fs:
        started = time.perf_counter()
        res = run("export", "--target", tiny_llama_dir, "--out", fs / "deep" / "bundle")
        assert res.exit_code == 2 and len(error_lines(res)) == 1, res.output
        assert "read-only" in error_lines(res)[0] and str(fs) in error_lines(res)[0]
        assert "[target] load" not in res.output and time.perf_counter() - started < 10  # before the slow load


def test_export_onto_a_full_file_system_is_one_line_with_the_space_needed(tiny_llama_dir, tmp_path):
    with tmpfs(tmp_path, "64k") as fs:
        res = run("export", "--target", tiny_llama_dir, "--out", fs / "bundle", "--capacity", "64")
        assert res.exit_code == 2 and len(error_lines(res)) == 1, res.output
        line = error_lines(res)[0]
        assert "is full" in line and "the bundle needs about" in line and "MB are free" in line, line
        assert sorted(p.name for p in fs.iterdir()) == []  # the staging folder went with the failure


def test_export_drafter_and_train_draft_refuse_an_unwritable_out(tmp_path, tiny_llama_dir):
    with tmpfs(tmp_path, "1m", read_only=True) as fs:
        res = run("train-draft", "--method", "eagle", "--target", tiny_llama_dir, "--out", fs / "work")
        assert res.exit_code == 2 and "read-only" in error_lines(res)[0], res.output
        (tmp_path / "heads").mkdir()
        res = run("export-drafter", tmp_path / "heads", "--out", fs / "drafter")
        assert res.exit_code == 2 and "read-only" in error_lines(res)[0], res.output


def test_bench_json_onto_a_full_disk_keeps_the_results(tiny_bundle, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["The quick brown fox"]}) + "\n")
    with tmpfs(tmp_path, "64k", fill=True) as fs:
        res = run(
            "bench", tiny_bundle, "--methods", "plain", "--prompts", prompts, "--n-per-category", "1",
            "--max-new-tokens", "4", "--threads", "1", "--json", fs / "b.json",
        )  # fmt: skip
        assert res.exit_code == 2 and len(error_lines(res)) == 1, res.output
        assert "--json" in error_lines(res)[0] and "No space left" in error_lines(res)[0]
        assert "Markdown table printed above" in error_lines(res)[0]
        assert "| qa " in res.stdout, res.stdout  # the results, on stdout
        assert not (fs / "b.json").exists()


def test_stale_staging_folders_of_killed_exports_are_removed(tmp_path):
    out = tmp_path / "bundle"
    stale = tmp_path / ".bundle.partial-dead1234"
    (stale / "target").mkdir(parents=True)
    (stale / "target" / "model.onnx.data").write_bytes(b"\0" * 4096)  # what a kill -9 left
    other = tmp_path / ".other.partial-dead5678"  # another output's: not ours to remove
    other.mkdir()
    old = time.time() - 3600
    for path in (stale, other):
        os.utime(path, (old, old))
    with StagingDir(out) as live:  # a running export: locked, so not stale to another one
        os.utime(live.path, (old, old))
        assert not stale.exists() and other.exists() and live.path.exists()
        assert remove_stale_staging(out) == [] and live.path.exists()
        live.commit(minimal_manifest(live.path))
    assert read_manifest(out, check_files=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.partial-dead5678", "bundle"]


def test_two_exports_onto_one_out_without_force_do_not_replace_each_other(tmp_path):
    out = tmp_path / "bundle"
    first, second = StagingDir(out), StagingDir(out)  # both start while --out does not exist
    with first, second:
        (first.path / "mark").write_text("first")
        (second.path / "mark").write_text("second")
        first.commit(minimal_manifest(first.path))
        with pytest.raises(SpecdecError, match="written by another export.*--force"):
            second.commit(minimal_manifest(second.path))
    assert (out / "mark").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]  # the loser's staging folder is gone
    with StagingDir(out, force=True) as forced:  # --force still replaces
        (forced.path / "mark").write_text("forced")
        forced.commit(minimal_manifest(forced.path))
    assert (out / "mark").read_text() == "forced"


def minimal_manifest(staging: Path) -> dict:
    """A manifest (without files) of a one-graph bundle, enough for ``commit`` to check it."""
    (staging / "target").mkdir(exist_ok=True)
    (staging / "target" / "model.onnx").write_bytes(b"x")
    (staging / "tokenizer.json").write_text("{}")
    cache = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "capacity": 16, "dtype": "float32"}
    graph = {
        "path": "target/model.onnx",
        "flavour": "ort",
        "dtype": "fp32",
        "vocab_size": 8,
        "hidden_size": 8,
        "batch_invariant": True,
        "min_pass_width": 2,
        "tree_invariant": True,
        "verdict": {"max_width": 64, "device": {}, "details": {}},
    }
    return {
        "schema_version": SCHEMA_VERSION,
        "exporter": {"name": "specdec-edge", "version": "test"},
        "target": {
            "role": "target", "source": "x", "revision": None, "architecture": "llama",
            "hf_architecture": "LlamaForCausalLM", "graph": {**graph, "cache": cache},
        },
        "tokenizer": {
            "file": "tokenizer.json", "vocab_size": 8, "eos_token_ids": [1], "bos_token_id": None,
            "pad_token_id": None, "add_bos_token": False, "chat_template": None,
        },
    }  # fmt: skip


class Planted:
    """A pickle that runs code when it is unpickled: what a hostile work folder would hold."""

    def __reduce__(self):
        return (os.system, (f"touch {MARK}",))


MARK = Path(f"/tmp/specdec-edge-planted-{os.getpid()}")


def test_a_planted_checkpoint_pickle_does_not_run(tmp_path):
    import torch
    from torch import nn

    from specdec_edge.errors import ExportError
    from specdec_edge.export.train_draft import Checkpoint, Training

    MARK.unlink(missing_ok=True)
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(pickle.dumps({"settings": {}, "payload": Planted()}))
    with pytest.raises(ExportError, match="cannot be loaded safely|not a training checkpoint"):
        Checkpoint(path, {}).resume(None)
    assert not MARK.exists(), "the planted pickle ran code"
    # A checkpoint that train-draft itself wrote still resumes (weights, optimizer, schedule, step).
    torch.manual_seed(0)
    saved = Training.start(nn.Linear(4, 4), [[0]] * 8, 1e-2)
    saved.advance(saved.head(torch.ones(1, 4)).square().sum(), 0.5)
    settings = {"method": "eagle", "config": {"layers": (1, 2)}, "steps": 8, "lr": 1e-2, "seed": 0}
    Checkpoint(tmp_path / "real.pt", settings).save(saved)
    resumed = Training.start(nn.Linear(4, 4), [[0]] * 8, 1e-2)
    Checkpoint(tmp_path / "real.pt", settings).resume(resumed)
    assert resumed.step == 1 and torch.equal(resumed.head.weight, saved.head.weight)
    assert resumed.schedule.last_epoch == saved.schedule.last_epoch


def test_the_default_capacity_is_the_models_positions_when_fewer_than_2048(tiny_llama_dir, tmp_path):
    out = tmp_path / "b"
    res = CliRunner().invoke(main, ["export", "--target", str(tiny_llama_dir), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "KV cache capacity 512 tokens: the model's positions" in res.output
    assert json.loads((out / "manifest.json").read_text())["target"]["graph"]["cache"]["capacity"] == 512
    res = run("export", "--target", tiny_llama_dir, "--out", tmp_path / "c", "--capacity", "513")
    assert res.exit_code == 2 and "512 positions" in error_lines(res)[0]
    res = run("train-draft", "--method", "eagle", "--target", tiny_llama_dir, "--out", tmp_path / "w", "--capacity",
              "513")  # fmt: skip
    assert res.exit_code == 2 and "512 positions" in error_lines(res)[0] and "--capacity 512" in error_lines(res)[0]


def test_build_engines_into_a_read_only_bundle_is_one_line_before_tensorrt_loads(portable_bundle, tmp_path):
    """build-engines writes into the bundle: a read-only one (a bundle on a read-only mount, a container
    image) is refused first, with the fix, before TensorRT is needed (none is installed here)."""
    import shutil

    with tmpfs(tmp_path, "64m") as fs:
        bundle = fs / "bundle"
        shutil.copytree(portable_bundle, bundle)
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        res = run("build-engines", bundle, "--backend", "trt-rtx", "--compute-capability", "8.9")
        assert res.exit_code == 2 and len(error_lines(res)) == 1, res.output
        line = error_lines(res)[0]
        assert "read-only" in line and "copy the bundle to a writable folder" in line, line
