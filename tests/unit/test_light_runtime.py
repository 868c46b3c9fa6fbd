"""The light runtime (api, loop, engines, bundle, bench, `chat`/`generate`/`info`) imports no torch or transformers."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HEAVY = ("torch", "transformers", "onnx")


def run_clean(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, then print which heavy modules it imported."""
    check = f"import sys; print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    script = f"import atexit\natexit.register(lambda: exec({check!r}))\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def heavy_modules(res: subprocess.CompletedProcess) -> str:
    return res.stdout.rsplit("HEAVY ", 1)[1].strip()


def test_pipeline_generates_without_heavy_imports(tiny_bundle):
    res = run_clean(f"""
        import specdec_edge.api.pipeline, specdec_edge.runtime, specdec_edge.speculative.loop
        import specdec_edge.speculative.proposers, specdec_edge.speculative.stats, specdec_edge.cli.run
        import specdec_edge.bundle.hashes, specdec_edge.bundle.write, specdec_edge.bench.sessions
        import specdec_edge.cli.info, specdec_edge.export.default_model
        from specdec_edge import Pipeline
        result = Pipeline.load({str(tiny_bundle)!r}).generate("The quick brown fox", max_new_tokens=8)
        print("TOKENS", len(result.token_ids))
    """)
    assert res.returncode == 0, res.stderr
    assert "TOKENS" in res.stdout and heavy_modules(res) == "[]"


def test_runtime_commands_without_heavy_imports(tiny_bundle):
    generate = ["generate", str(tiny_bundle), "--prompt", "hi", "--max-new-tokens", "4"]
    for args in (["chat", "--help"], ["serve", "--help"], generate):
        res = run_clean(f"""
            import sys
            sys.argv = ["specdec-edge", *{args!r}]
            from specdec_edge.cli import main
            try:
                main()
            except SystemExit as e:
                assert not e.code, e.code
        """)
        assert res.returncode == 0, res.stderr
        assert heavy_modules(res) == "[]", args


def test_server_without_heavy_imports(tiny_bundle):
    res = run_clean(f"""
        from specdec_edge import Pipeline
        from specdec_edge.serve.app import create_app
        create_app(Pipeline.load({str(tiny_bundle)!r}), model="tiny")
    """)
    assert res.returncode == 0, res.stderr
    assert heavy_modules(res) == "[]"
