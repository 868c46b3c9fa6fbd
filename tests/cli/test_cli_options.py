"""`-o KEY=VALUE` method options through chat/generate/bench."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from specdec_edge.cli import main
from specdec_edge.cli.options import parse_options


def test_parse_options_types_and_errors():
    assert parse_options(["window=5", "ratio=0.5", "flag=true", "name=x"]) == {
        "window": 5,
        "ratio": 0.5,
        "flag": True,
        "name": "x",
    }
    assert parse_options(["pld.max_ngram=4", "lookahead.window=2"], per_method=True) == {
        "pld": {"max_ngram": 4},
        "lookahead": {"window": 2},
    }
    with pytest.raises(click.BadParameter):
        parse_options(["window"])
    with pytest.raises(click.BadParameter):
        parse_options(["window=2"], per_method=True)


def test_generate_with_method_options_matches_plain(tiny_bundle):
    runner = CliRunner()
    base = ["generate", str(tiny_bundle), "--prompt", "The quick brown fox", "--max-new-tokens", "20", "--json"]
    plain = json.loads(runner.invoke(main, [*base, "--method", "plain"]).stdout)
    result = runner.invoke(main, [*base, "--method", "lookahead", "-o", "window=2", "-o", "ngram=2", "-o", "guesses=1"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["token_ids"] == plain["token_ids"]


def test_unknown_method_option_is_a_clear_error(tiny_bundle):
    result = CliRunner().invoke(
        main, ["generate", str(tiny_bundle), "--prompt", "hi", "--method", "pld", "-o", "windw=2"]
    )
    assert result.exit_code == 2
    assert "bad option for method 'pld'" in result.output and "Traceback" not in result.output
