"""A small Tk chat window: answers stream from a worker thread; Stop cancels the answer.

    python samples/chat_window.py bundles/smollm2

``run_once(bundle, prompt)`` drives the window without a person (used by the tests).
"""

import queue
import sys
import threading
import time
import tkinter as tk

from specdec_edge import Pipeline, SpecdecError


class ChatWindow:
    def __init__(self, root: tk.Tk, pipe: Pipeline, max_new_tokens: int = 256):
        self.root, self.pipe, self.max_new_tokens = root, pipe, max_new_tokens
        self.history: list[dict] = []
        self.pieces: queue.Queue = queue.Queue()  # worker -> UI thread: text pieces, then None
        self.stream = None
        self.answer = ""
        self.result = None  # the last finished answer's GenerationResult
        root.title("specdec-edge chat")
        self.text = tk.Text(root, wrap="word", height=20, width=80, state="disabled")
        self.text.pack(fill="both", expand=True)
        bar = tk.Frame(root)
        bar.pack(fill="x")
        self.entry = tk.Entry(bar)
        self.entry.pack(side="left", fill="x", expand=True)
        self.entry.bind("<Return>", lambda _: self.send())
        self.send_button = tk.Button(bar, text="Send", command=self.send)
        self.send_button.pack(side="left")
        self.stop_button = tk.Button(bar, text="Stop", command=self.stop, state="disabled")
        self.stop_button.pack(side="left")
        self.status = tk.Label(root, anchor="w", fg="gray")
        self.status.pack(fill="x")

    def write(self, text: str) -> None:
        self.text.configure(state="normal")
        self.text.insert("end", text)
        self.text.see("end")
        self.text.configure(state="disabled")

    def send(self) -> None:
        prompt = self.entry.get().strip()
        if not prompt or self.stream is not None:
            return
        try:
            stream = self.pipe.stream(
                [*self.history, {"role": "user", "content": prompt}], max_new_tokens=self.max_new_tokens
            )
        except SpecdecError as e:
            self.status.configure(text=str(e))
            return
        self.entry.delete(0, "end")
        self.history.append({"role": "user", "content": prompt})
        self.write(f"\nYou: {prompt}\nAssistant: ")
        self.answer, self.stream, self.result = "", stream, None
        self.send_button.configure(state="disabled")
        self.stop_button.configure(state="normal")
        threading.Thread(target=self.work, args=(self.stream,), daemon=True).start()
        self.root.after(20, self.poll)

    def work(self, stream) -> None:
        for piece in stream:
            self.pieces.put(piece)
        self.pieces.put(None)

    def stop(self) -> None:
        if self.stream is not None:
            self.stream.cancel()  # safe from the UI thread; the worker's loop then ends

    def poll(self) -> None:
        while not self.pieces.empty():
            piece = self.pieces.get()
            if piece is None:
                return self.finish()
            self.answer += piece
            self.write(piece)
        self.root.after(20, self.poll)

    def finish(self) -> None:
        self.result = result = self.stream.result
        self.history.append({"role": "assistant", "content": result.text})
        self.status.configure(
            text=f"{result.finish_reason}: {result.stats.tokens_per_s:.1f} tok/s, "
            f"{result.stats.tokens_per_pass:.2f} tokens per target pass"
        )
        self.stream = None
        self.send_button.configure(state="normal")
        self.stop_button.configure(state="disabled")


class _HeldAfterFirstPiece(queue.Queue):
    """The worker's queue for ``run_once``: after the first piece the worker waits until Stop was pressed, so a
    short answer cannot reach its end before the window shows it (a race a fast machine loses)."""

    def __init__(self, timeout_s: float):
        super().__init__()
        self.stopped, self.timeout_s, self.first = threading.Event(), timeout_s, True

    def put(self, item, block=True, timeout=None):
        super().put(item, block, timeout)
        if item is not None and self.first:
            self.first = False
            self.stopped.wait(self.timeout_s)


def run_once(bundle: str, prompt: str, max_new_tokens: int = 200, timeout_s: float = 30.0):
    """Open the window, send ``prompt``, press Stop once the answer started; return the GenerationResult."""
    root = tk.Tk()
    window = ChatWindow(root, Pipeline.load(bundle), max_new_tokens)
    window.pieces = held = _HeldAfterFirstPiece(timeout_s)
    window.entry.insert(0, prompt)
    window.send_button.invoke()
    deadline = threading.Event()
    root.after(int(timeout_s * 1000), deadline.set)
    while window.stream is not None and not deadline.is_set():
        root.update()
        time.sleep(0.005)
        if window.answer and not held.stopped.is_set():
            window.stop_button.invoke()
            held.stopped.set()
    result = window.result
    root.destroy()
    if result is None:
        raise TimeoutError(f"no answer within {timeout_s} s: {window.status.cget('text')!r}")
    return result


if __name__ == "__main__":
    root = tk.Tk()
    ChatWindow(root, Pipeline.load(sys.argv[1]))
    root.mainloop()
