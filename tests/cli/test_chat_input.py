"""The chat REPL's input: unknown /commands, answers stopped with Ctrl-C (not kept in the conversation),
and line editing and history through readline in a real terminal (a pseudo-terminal here)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from specdec_edge import Pipeline
from specdec_edge.api import streaming
from specdec_edge.cli import main


def chat(bundle, text: str):
    res = CliRunner().invoke(main, ["chat", str(bundle), "--max-new-tokens", "12", "--threads", "1"], input=text)
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    return res.output


def test_unknown_commands_are_not_sent_to_the_model(tiny_bundle):
    out = chat(tiny_bundle, "/help\n/rest\n/exit\n")
    assert "Unknown command /help; the commands are /reset, /stats and /exit." in out
    assert "Unknown command /rest" in out and "tokens per target pass" not in out
    out = chat(tiny_bundle, "/etc/hosts has what in it?\n/exit\n")  # more than one word: a message
    assert "Unknown command" not in out and out.count("tokens per target pass") == 1


def test_commands_with_arguments_are_refused_not_sent(tiny_bundle):
    out = chat(tiny_bundle, "/stats x\n/reset now\n/exit please\n/stats\n/exit\n")
    for command in ("/stats", "/reset", "/exit"):
        assert f"Error: {command} takes no arguments" in out
    assert "tokens per target pass" not in out and "(no answer yet)" in out  # nothing went to the model
    out = chat(tiny_bundle, "  /exit  \n")  # the command word, spaces around it or not
    assert "Error" not in out


def test_a_line_that_is_not_utf8_is_reported_in_the_line_typed(tiny_bundle):
    """A terminal in another encoding: Python's stdin (UTF-8 mode) hands over the bad byte as a lone surrogate."""
    proc = subprocess.run(
        [sys.executable, "-c", "from specdec_edge.cli import main; main()", "chat", str(tiny_bundle), "--threads", "1",
         "--max-new-tokens", "4"],
        input=b"caf\xe9 au lait\nhello\n/exit\n",
        capture_output=True,
        env={**os.environ, "PYTHONUTF8": "1"},
        timeout=120,
    )  # fmt: skip
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0, err
    assert "not valid UTF-8 text (byte 0xE9 at character 4 of the line)" in err, err
    assert "Traceback" not in err and "unpaired surrogate" not in err
    assert proc.stdout.decode().count("tokens per target pass") == 1  # the next line was answered


@pytest.mark.parametrize("stop_at", [1, 2])  # before any text, and after the first piece
def test_a_stopped_answer_is_not_kept_in_the_conversation(tiny_bundle, monkeypatch, stop_at):
    fresh = Pipeline.load(tiny_bundle, threads=1).generate([{"role": "user", "content": "again"}], max_new_tokens=12)
    feed, calls = streaming.StopFilter.feed, []

    def interrupted(self, text):  # Ctrl-C arriving while the first answer streams
        calls.append(text)
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        return feed(self, text)

    monkeypatch.setattr(streaming.StopFilter, "feed", interrupted)
    out = chat(tiny_bundle, "hello\nagain\n/exit\n")
    assert "[stopped]" in out and "(not kept in the conversation)" in out
    # The second answer is the one a conversation holding only "again" gets: "hello" was dropped with its answer.
    assert fresh.text in out and out.count("tokens per target pass") == 2


def read_until(fd: int, text: bytes, seen: bytearray, times: int = 1, timeout: float = 90) -> None:
    """Read the terminal into ``seen`` until ``text`` has appeared ``times`` times."""
    deadline = time.monotonic() + timeout
    while seen.count(text) < times:
        left = deadline - time.monotonic()
        assert left > 0, f"no {text!r} in {bytes(seen)[-400:]!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                seen += os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break


def test_arrow_keys_edit_the_line_and_recall_history(tiny_bundle):
    pytest.importorskip("readline")
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from specdec_edge.cli import main; main()", "chat", str(tiny_bundle), "--threads", "1"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "xterm"},
        close_fds=True,
    )
    os.close(slave)
    seen = bytearray()
    try:
        read_until(master, b">>> ", seen)
        os.write(master, b"/stats\r")
        read_until(master, b">>> ", seen, 2)
        os.write(master, b"\x1b[A\r")  # Up: the previous line again
        read_until(master, b">>> ", seen, 3)
        assert seen.count(b"(no answer yet)") == 2
        os.write(master, b"/ext\x1b[Di\r")  # Left, then "i": "/exit" only when the line can be edited
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
