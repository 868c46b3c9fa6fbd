"""Bad input, at each option's boundary and just past it, through the command line and the Python API.

Past the boundary: the CLI exits with status 2 and one "Error:" line that names the problem (click's own
usage errors add their usage lines), never a traceback; the API raises one ``SpecdecError`` whose message
is one line. At the boundary: it works."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from specdec_edge import Pipeline, SpecdecError
from specdec_edge.cli import main
from specdec_edge.cli.run import unescape


def run(*args, input=None):
    res = CliRunner().invoke(main, [str(a) for a in args], input=input)
    assert res.exception is None or isinstance(res.exception, SystemExit), f"{args}: {res.exception!r}"
    assert "Traceback" not in res.output, res.output
    return res


def refused(res, *words):
    errors = [line for line in res.output.splitlines() if line.startswith("Error")]
    assert res.exit_code == 2, f"exit {res.exit_code}: {res.output}"
    assert len(errors) == 1, res.output
    assert all(w.lower() in errors[0].lower() for w in words), f"{words} not in {errors[0]!r}"


GEN = ["--prompt", "The quick", "--max-new-tokens", "3", "--threads", "1"]
PAST = [  # (extra arguments, words the error names)
    (["--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--max-new-tokens", "-1"], ["--max-new-tokens"]),
    (["--max-new-tokens", "abc"], ["--max-new-tokens"]),
    (["--max-new-tokens", "100000"], ["KV cache capacity"]),
    (["-k", "0"], ["-k"]),
    (["--temperature", "-0.1"], ["--temperature"]),
    (["--temperature", "inf"], ["temperature=inf"]),
    (["--temperature", "nan"], ["temperature"]),
    (["--top-k", "-1"], ["--top-k"]),
    (["--top-p", "0"], ["--top-p"]),
    (["--top-p", "1.01"], ["--top-p"]),
    (["--seed", "-1"], ["--seed"]),
    (["--seed", "1.5"], ["--seed"]),
    (["--threads", "0"], ["--threads"]),
    (["--threads", "-2"], ["--threads"]),
    (["--method", "jacobi"], ["--method"]),
    (["--provider", "tpu"], ["--provider"]),
    (["--method", "lookahead", "-o", "window=0"], ["window=0", "from 1 to 64"]),
    (["--method", "lookahead", "-o", "window=65"], ["window=65"]),
    (["--method", "lookahead", "-o", "ngram=1"], ["ngram=1", "from 2 to 16"]),
    (["--method", "pld", "-o", "max_ngram=0"], ["max_ngram=0"]),
    (["--method", "pld", "-o", "max_ngram=abc"], ["max_ngram='abc'", "an integer"]),
    (["--method", "pld", "-o", "min_ngram=3", "-o", "max_ngram=2"], ["min_ngram <= max_ngram"]),
    (["--method", "pld", "-o", "windw=3"], ["no option 'windw'"]),
    (["--method", "pld", "-o", "max_ngram"], ["KEY=VALUE"]),
    (["--method", "eagle"], ["no eagle heads"]),
    (["--threads", "1025"], ["--threads"]),
    (["--stop", "x" * 1001], ["1001 characters", "limit of 1000"]),
    (["--stop", "a"] * 17, ["17 strings", "limit of 16"]),
    (["--method", "pld", "-o", "max_ngram=" + "9" * 5000], ["max_ngram=", "from 1 to 64"]),
    (["--method", "lookahead", "-o", "seed=" + "9" * 40], ["seed="]),
]


@pytest.mark.parametrize("extra,words", PAST, ids=[" ".join(a) for a, _ in PAST])
def test_generate_refuses_values_past_the_boundary(tiny_bundle, extra, words):
    refused(run("generate", tiny_bundle, *GEN, *extra), *words)


def test_generate_accepts_the_boundaries(tiny_bundle):
    res = run(
        "generate", tiny_bundle, "--prompt", "The quick", "--max-new-tokens", "1", "--threads", "1", "-k", "1",
        "--temperature", "0", "--top-k", "0", "--top-p", "1", "--seed", "0", "--json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["stats"]["new_tokens"] == 1
    res = run("generate", tiny_bundle, *GEN, "--method", "lookahead", "-o", "window=64", "-o", "ngram=16")
    assert res.exit_code == 0, res.output


def test_other_commands_refuse_bad_input(tiny_bundle, tiny_llama_dir, tmp_path):
    (tmp_path / "file").write_text("x")
    cases = [
        (["generate", tmp_path / "nope", "--prompt", "x"], ["does not exist"]),
        (["generate", tmp_path / "file", "--prompt", "x"], ["not a specdec-edge bundle"]),
        (["generate", tiny_bundle, "--prompt", ""], ["no tokens"]),
        (["generate", tiny_bundle, "--prompt", "a\udcffb"], ["unpaired surrogate"]),  # undecodable bytes in argv
        (["chat", tiny_bundle, "--temperature", "inf"], ["temperature=inf"]),
        (["chat", tiny_bundle, "--seed", "-1"], ["--seed"]),
        (["info", tmp_path / "nope"], ["does not exist"]),
        (["verify", tmp_path], ["not a specdec-edge bundle"]),
        (["bench", tiny_bundle, "--json", tmp_path / "missing" / "b.json"], ["--json", "does not exist"]),
        (["bench", tiny_bundle, "--md", tmp_path], ["--md", "is a directory"]),
        (["bench", tiny_bundle, "--methods", "plain,jacobi"], ["jacobi"]),
        (["bench", tiny_bundle, "--n-per-category", "0"], ["--n-per-category"]),
        (["bench", tiny_bundle, "--temperature", "-1"], ["--temperature"]),
        (["bench", tiny_bundle, "--prompts", tmp_path / "none.jsonl"], ["does not exist"]),
        (["bench", tiny_bundle, "-o", "window=3"], ["METHOD.KEY=VALUE"]),
        (["export", "--target", tiny_llama_dir, "--out", tmp_path / "o", "--capacity", "15"], ["--capacity 15"]),
        (["export", "--target", tiny_llama_dir, "--out", tmp_path / "o", "--capacity", "513"], ["512 positions"]),
        (["export", "--target", tiny_llama_dir, "--out", tmp_path / "o", "--capacity", str(10**12)], ["positions"]),
        (["export", "--target", tiny_llama_dir, "--out", tmp_path / "o", "--heads", tiny_bundle], ["not a heads"]),
        (["export", "--target", tiny_llama_dir, "--out", tmp_path / "file"], ["is a file"]),
        (["export", "--target", tmp_path / "none", "--out", tmp_path / "o"], ["does not exist"]),
        (["export", "--target", tiny_llama_dir, "--out", tmp_path / "o", "--dtype", "int3"], ["--dtype"]),
        (["train-draft", "--method", "eagle", "--target", tiny_llama_dir, "--out", tmp_path, "--epochs", "0"], []),
        (["build-engines", tmp_path / "nope"], ["does not exist"]),
        (["export", "--target", tiny_llama_dir, "--out", tmp_path / "file" / "o"], ["is a file"]),
        (
            [
                "train-draft",
                "--method",
                "medusa",
                "--target",
                tiny_llama_dir,
                "--out",
                tmp_path,
                "--medusa-heads",
                "65",
            ],
            ["--medusa-heads"],
        ),
        (
            ["train-draft", "--method", "eagle", "--target", tiny_llama_dir, "--out", tmp_path, "--capacity", "8"],
            ["--capacity"],
        ),
        (["serve", tiny_bundle, "--max-queue", "5000"], ["--max-queue"]),
        (["serve", tiny_bundle, "--max-body-bytes", str(1 << 30)], ["--max-body-bytes"]),
        (["serve", tiny_bundle, "--timeout", "1e9"], ["--timeout"]),
        (["bench", tiny_bundle, "--threads", "5000"], ["--threads"]),
    ]
    for args, words in cases:
        refused(run(*args), *words)
    assert not (tmp_path / "o").exists()


def test_check_capacity_bounds_the_kv_cache_by_memory():
    from specdec_edge.errors import ExportError
    from specdec_edge.export.exporter import check_capacity

    smollm2 = {"smollm2": (8192, 46080)}  # 30 layers x 2 x 3 KV heads x 64 x 4 bytes per token
    check_capacity(8192, smollm2, memory=8 * 10**9)
    with pytest.raises(ExportError, match="exceeds the 8192 positions"):
        check_capacity(8193, smollm2, memory=8 * 10**9)
    with pytest.raises(ExportError, match=r"needs a 0\.4 GB KV cache, more than half of this machine's 0\.5 GB"):
        check_capacity(8192, smollm2, memory=5 * 10**8)


def test_stop_escapes_as_the_help_shows(tiny_bundle):
    help_text = run("generate", "--help").output
    assert '--stop "\\n\\n"' in help_text  # the example as the user reads (and types) it
    assert unescape("\\n\\n") == "\n\n" and unescape("a\\tb\\\\n") == "a\tb\\n" and unescape("\\x") == "\\x"
    plain = Pipeline.load(tiny_bundle, method="plain", threads=1)
    for prompt in ("def b The", "def add(a, b):", "The quick brown fox"):  # the first writes a newline
        full = plain.generate(prompt, max_new_tokens=60).text
        if "\n" in full:
            break
    else:
        pytest.skip("the tiny model wrote no newline")
    res = run("generate", tiny_bundle, "--prompt", prompt, "--max-new-tokens", "60", "--method", "plain",
              "--stop", "\\n", "--json")  # fmt: skip
    out = json.loads(res.stdout)
    assert out["finish_reason"] == "stop" and out["text"] == full[: full.index("\n")]


@pytest.fixture(scope="module")
def pipe(tiny_bundle):
    return Pipeline.load(tiny_bundle, threads=1)


API_PAST = [
    ("max_new_tokens", [0, -1, True, 1.5, None, "3", 10**6]),
    ("temperature", [-0.1, math.inf, math.nan, True, "0.5", None]),
    ("top_k", [-1, True, 1.5, None]),
    ("top_p", [0, 1.01, math.nan, True, None]),
    ("seed", [-1, True, 1.5, "1"]),
    ("stop", [3, [1], {"a": 1}, [b"x"], "x" * 1001, ["x" * 500000], ["a"] * 17]),
]


@pytest.mark.parametrize("name,values", API_PAST, ids=[n for n, _ in API_PAST])
def test_api_generate_refuses_values_past_the_boundary(pipe, name, values):
    for value in values:
        with pytest.raises(SpecdecError, match=name if name != "max_new_tokens" or value != 10**6 else "capacity") as e:
            pipe.generate("The quick", max_new_tokens=3, **{name: value}) if name != "max_new_tokens" else (
                pipe.generate("The quick", max_new_tokens=value)
            )
        assert "\n" not in str(e.value)


def test_api_generate_accepts_the_boundaries(pipe):
    result = pipe.generate(
        "The quick", max_new_tokens=1, temperature=0, top_k=0, top_p=1, seed=0, stop=[]
    )  # fmt: skip
    assert result.stats.new_tokens == 1
    sampled = pipe.generate("The quick", max_new_tokens=2, temperature=1e-3, top_k=1, top_p=1e-9, seed=np.int64(2**40))
    assert len(sampled.token_ids) <= 2
    greedy = pipe.generate("The quick", max_new_tokens=6).token_ids
    for tiny in (5e-324, 1e-300):  # the range check accepts them: sampling at them is greedy
        assert pipe.generate("The quick", max_new_tokens=6, temperature=tiny, seed=1).token_ids == greedy
    at_limits = pipe.generate("The quick", max_new_tokens=2, stop=["x" * 1000] * 16)
    assert at_limits.stats.new_tokens == 2


def test_api_sizes_past_their_bounds(pipe):
    from specdec_edge.api.pipeline import MAX_CHARS_PER_TOKEN
    from specdec_edge.tokenizer import MAX_MESSAGES

    cases = [
        ("x" * (MAX_CHARS_PER_TOKEN * pipe.engines.capacity + 1), "characters"),
        ([{"role": "user", "content": "x" * (MAX_CHARS_PER_TOKEN * pipe.engines.capacity + 1)}], "characters"),
        ([{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1), "messages"),
    ]
    for prompt, word in cases:
        with pytest.raises(SpecdecError, match=word) as e:
            pipe.generate(prompt, max_new_tokens=2)
        assert "\n" not in str(e.value) and len(str(e.value)) < 300
    from specdec_edge.speculative.methods import get_method

    for tree in ([[0]] * 65, [[64]], [[0] * 65], [[-1]], "[" * 100000):
        with pytest.raises(SpecdecError, match="tree=") as e:
            get_method("medusa").check_options({"tree": tree})
        assert len(str(e.value)) < 400


def test_the_stop_filter_cuts_where_the_naive_check_does():
    """Against the obvious (quadratic) reference on random text and stops over a small alphabet."""
    import random

    from specdec_edge.api.streaming import StopFilter

    def naive(stops, pieces):
        text = ""
        for piece in pieces:
            text += piece
            hits = [i for i in (text.find(s) for s in stops) if i >= 0]
            if hits:
                return text[: min(hits)], True
        return text, False

    rng = random.Random(7)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        pieces = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 8))]
        f, out, stopped = StopFilter(stops), "", False
        for piece in pieces:
            emitted, stopped = f.feed(piece)
            out += emitted
            if stopped:
                break
        if not stopped:
            out += f.flush()
        assert (out, stopped) == naive(stops, pieces), (stops, pieces)


def test_a_long_stop_string_costs_little_per_token():
    """The stop-string check is linear in the text fed: a 200,000-character stop took ~0.75 s a token."""
    import time

    from specdec_edge.api.streaming import StopFilter

    stop = "ab" * 100000
    f = StopFilter([stop])
    started = time.perf_counter()
    out = "".join(f.feed("ab")[0] for _ in range(200))
    assert time.perf_counter() - started < 2.0  # 200 tokens; quadratic: minutes
    assert out == "" and f.held == "ab" * 200  # all of it may still start the stop string
    assert f.feed("c") == ("ab" * 200 + "c", False)


def test_api_prompts_and_load_options(pipe, tiny_bundle):
    for prompt in ("", None, 123, b"hi", [], [{"role": "user"}], [{"role": "user", "content": 3}], "a\ud800"):
        with pytest.raises(SpecdecError) as e:
            pipe.generate(prompt, max_new_tokens=2)
        assert "\n" not in str(e.value)
    bad_loads = [
        dict(threads=0),
        dict(threads=-2),
        dict(threads=True),
        dict(threads=1.5),
        dict(k=0),
        dict(k=True),
        dict(method="jacobi"),
        dict(provider="tpu"),
        dict(spinning="yes"),
        dict(method="lookahead", window=0),
        dict(method="lookahead", ngram=1),
        dict(method="pld", max_ngram=0),
        dict(method="pld", max_ngram="abc"),
        dict(method="pld", colour=1),
        dict(threads=10**6),
        dict(method="pld", max_ngram="9" * 5000),
    ]
    for options in bad_loads:
        with pytest.raises(SpecdecError) as e:
            Pipeline.load(tiny_bundle, **{"threads": 1, **options})
        assert "\n" not in str(e.value), options
