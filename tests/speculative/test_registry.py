"""The method registry is the one source: CLI choices, bench, info, README and DESIGN agree with it,
and method options are checked against it with clear errors (llama.cpp's static_assert habit)."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from specdec_edge import Pipeline, SpecdecError
from specdec_edge.bench.spec_bench import check_methods
from specdec_edge.cli import main
from specdec_edge.speculative.acceptance import ExactAcceptance, TypicalAcceptance
from specdec_edge.speculative.methods import (
    HEAD_METHODS,
    METHODS,
    available_methods,
    default_method,
    get_method,
    methods_table,
)

ROOT = Path(__file__).resolve().parents[2]


def choices(command: str, option: str) -> list[str]:
    params = {p.name: p for p in main.commands[command].params}
    assert isinstance(params[option].type, click.Choice)
    return list(params[option].type.choices)


def test_cli_choices_come_from_the_registry():
    assert choices("generate", "method") == choices("chat", "method") == list(METHODS)
    assert set(choices("demo", "method")) == {"auto", "pld", "history", "lookahead", "eagle", "pld-eagle"}
    assert check_methods(list(METHODS)) == list(METHODS)  # bench takes every method, plain first
    help_text = CliRunner().invoke(main, ["generate", "-h"]).output
    for name in METHODS:
        assert f"{name}:" in help_text.replace("\n", " ")


def test_readme_and_design_follow_the_registry():
    readme = (ROOT / "README.md").read_text()
    assert methods_table() in readme, "README's methods table is stale: paste speculative.methods.methods_table()"
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    missing = [name for name in METHODS if f"`{name}`" not in design]
    assert not missing, f"docs/DESIGN.md does not describe {missing}"


def test_records_are_consistent():
    assert next(iter(METHODS)) == "plain"  # the baseline comes first (bench, info and the README list them so)
    for name, m in METHODS.items():
        assert m.name == name and re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", name), name  # a CLI choice as it is

        assert set(m.needs) <= {"draft", *HEAD_METHODS}, m.name
        names = [o.name for o in m.options]
        assert len(names) == len(set(names)), m.name
        for o in m.options:  # every default is valid for its own option
            assert o.default is None or o.parse(m.name, o.default) == o.default, (m.name, o.name)
    # The methods whose proposers read the target's features (trained heads), and auto where a bundle has heads.
    feature_readers = ["eagle", "medusa", "medusa-typical", "pld-eagle", "eagle3", "pld-eagle3"]
    assert [m.name for m in METHODS.values() if m.reads_features] == feature_readers
    assert METHODS["auto"].taps_features(["eagle"]) and not METHODS["auto"].taps_features([])
    assert not METHODS["pld"].taps_features(["eagle", "medusa"])
    # Options split into the proposer's and the rule's, defaults filled in; the tree settings default to the bundle's.
    assert METHODS["pld-eagle"].check_options({"topk": 2}) == ({"max_ngram": 3, "min_ngram": 2, "topk": 2}, {})
    assert METHODS["eagle"].check_options({}) == ({}, {})
    typical = METHODS["medusa-typical"]
    proposer_options, rule_options = typical.check_options({"delta": 0.5})
    rule = typical.acceptance(rule_options)
    assert proposer_options == {} and isinstance(rule, TypicalAcceptance) and (rule.epsilon, rule.delta) == (0.09, 0.5)
    assert isinstance(METHODS["pld"].acceptance(METHODS["pld"].check_options({})[1]), ExactAcceptance)
    assert [m.name for m in METHODS.values() if m.lossy] == ["medusa-typical"]
    assert [m.name for m in METHODS.values() if not m.speculative] == ["plain"]


def test_requirements_and_defaults():
    assert available_methods(False, []) == ["plain", "auto", "pld", "history", "lookahead"]
    assert available_methods(True, ["eagle"]) == [
        "plain",
        "auto",
        "draft",
        "pld",
        "history",
        "lookahead",
        "eagle",
        "pld-eagle",
    ]
    assert "has no draft model" in METHODS["draft"].missing(False, [])
    assert "train-draft --method medusa" in METHODS["medusa-typical"].missing(True, ["eagle"])
    # What a bundle runs when no method is asked for: one it can run, exactly; a recorded default wins.
    assert default_method() == "auto" and default_method("pld") == "pld"  # export --default-method
    assert available_methods(False, ["eagle3"]) == [
        "plain",
        "auto",
        "pld",
        "history",
        "lookahead",
        "eagle3",
        "pld-eagle3",
    ]
    assert "train-draft --method eagle3" in METHODS["pld-eagle3"].missing(False, ["eagle"])
    with pytest.raises(SpecdecError, match="unknown method 'jacobi'; choose one of plain, auto, draft"):
        get_method("jacobi")


def test_options_are_parsed_and_checked():
    pld = METHODS["pld"]
    assert pld.check_options({}) == ({"max_ngram": 3, "min_ngram": 1}, {})
    assert pld.check_options({"max_ngram": "5"}) == ({"max_ngram": 5, "min_ngram": 1}, {})
    assert METHODS["pld-eagle"].check_options({}) == ({"max_ngram": 3, "min_ngram": 2}, {})
    assert METHODS["eagle"].check_options({"topk": 2}) == ({"topk": 2}, {})  # the rest: the bundle's settings
    assert METHODS["medusa"].check_options({"tree": "[[0], [0, 1]]"}) == ({"tree": [[0], [0, 1]]}, {})
    assert METHODS["medusa-typical"].check_options({"delta": 0.5}) == ({}, {"epsilon": 0.09, "delta": 0.5})
    assert METHODS["lookahead"].check_options({"prompt_ngrams": "false"})[0]["prompt_ngrams"] is False
    bad = [
        ("pld", {"max_ngram": 0}, r"max_ngram=0 is invalid; use an integer from 1 to 64 \(default: 3\)"),
        ("pld", {"max_ngram": 65}, r"max_ngram=65 is invalid; use an integer from 1 to 64"),
        ("pld", {"max_ngram": "abc"}, "max_ngram='abc' is invalid"),
        ("pld", {"max_ngram": True}, "max_ngram=True is invalid"),
        ("pld", {"max_ngram": 2.5}, "max_ngram=2.5 is invalid"),
        ("pld", {"windw": 2}, r"it has no option 'windw' \(its options: max_ngram, min_ngram\)"),
        ("plain", {"window": 2}, r"it has no option 'window' \(its options: none\)"),
        ("lookahead", {"ngram": 1}, "ngram=1 is invalid; use an integer from 2 to 16"),
        ("lookahead", {"window": 0}, "window=0 is invalid; use an integer from 1 to 64"),
        ("lookahead", {"window": 10**12}, "window=1000000000000 is invalid"),  # would allocate terabytes
        ("lookahead", {"seed": -1}, "seed=-1 is invalid"),
        ("medusa-typical", {"epsilon": 0}, r"epsilon=0 is invalid; use a number in \(0, 1\]"),
        ("medusa-typical", {"delta": 0}, "delta=0 is invalid; use a number > 0"),
        ("eagle", {"nodes": 65}, "nodes=65 is invalid; use an integer from 1 to 64"),
        ("medusa-typical", {"epsilon": float("inf")}, "epsilon=inf is invalid"),
        ("medusa", {"tree": "[[0], []]"}, "tree="),
        ("medusa", {"tree": "0,1"}, "tree="),
    ]
    for method, options, message in bad:
        with pytest.raises(SpecdecError, match=f"bad option for method '{re.escape(method)}': {message}"):
            METHODS[method].check_options(options)


def test_pipeline_reads_the_registry(tiny_bundle):
    plain = Pipeline.load(tiny_bundle, method="plain", threads=1)
    for name in available_methods(True, []):
        pipe = plain.with_method(name)
        assert isinstance(pipe.decoder.rule, METHODS[name].rule) and pipe.decoder.engine is plain.engines.target
    with pytest.raises(SpecdecError, match="has no eagle heads"):
        plain.with_method("pld-eagle")
    with pytest.raises(SpecdecError, match=r"min_ngram=0 is invalid"):
        plain.with_method("pld", min_ngram=0)
    with pytest.raises(SpecdecError, match=r"prompt lookup needs 1 <= min_ngram <= max_ngram"):
        plain.with_method("pld", min_ngram=4, max_ngram=2)


def test_info_lists_the_methods_a_bundle_can_run(tiny_bundle):
    res = CliRunner().invoke(main, ["info", str(tiny_bundle)])
    assert res.exit_code == 0 and "methods: plain, auto, draft, pld, history, lookahead" in res.output


def test_head_recipes_match_the_registry():
    from specdec_edge.export.head_recipes import HEAD_METHODS as TRAINABLE

    assert TRAINABLE == HEAD_METHODS  # every head kind a method needs can be trained and exported
