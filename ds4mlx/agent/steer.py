"""Steering the agent while a turn runs: the key reader and the queue (docs/ARCHITECTURE.md §7).

During ``Agent.send`` the terminal is in raw mode and :class:`KeyReader` reads it on its own
thread with prompt-toolkit's input layer (``create_input``: its VT100 parser turns escape
sequences into keys; a lone ``Esc`` is flushed after a short wait). MLX stays on the
thread that runs the turn. What the keys do:

- text and Backspace edit a line; **Enter** queues it (:class:`SteerQueue`) and the UI
  shows it queued. The turn loop polls the queue (the engine's one boundary rule,
  ``ds4mlx.engine.steer.Steering``) and stops at the next boundary: at once in reasoning
  or text, at the block's close inside a tool-call block. The agent then answers the calls
  not started with ``not run: the user interrupted with new instructions`` (a running
  foreground tool finishes first; calls started early keep their real results) and
  appends the queued text as the user's words in the same user turn (``Steps``);
- **Esc** stops at once, as Ctrl+C does (the model, or a running tool), and the queue
  (with the line being typed) is sent as the next message;
- a line starting with ``/`` is one of the agent's commands, never the model's words: it
  runs at the prompt once the turn ends (:attr:`SteerQueue.commands`);
- **Ctrl+C** is sent to the process as SIGINT (raw mode turns the terminal's own off), so
  the agent's handler stops the model or the running tool as before;
- while a permission or a command's input prompt is on screen (:meth:`KeyReader.read_line`),
  the next line typed answers it, echoed; a line queued earlier never does, and a line
  half typed when the prompt opened is kept for after it. Ctrl+D there is end of file.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from prompt_toolkit.input import create_input
from prompt_toolkit.keys import Keys

_POLL_S = 0.05  # select timeout; also how long a lone Esc waits for the rest of a sequence
_EOF = object()


class SteerQueue:
    """Lines typed while a turn runs, to be applied at the next boundary (thread-safe).

    Attributes:
        commands: ``/commands`` typed meanwhile, in order: they are the agent's, never
            the model's words, and run at the prompt once the turn ends (a ``/quit``
            typed mid-turn went to the model as a message).
    """

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self.commands: list[str] = []

    def push(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)

    def pending(self) -> bool:
        """True while a line is queued (the turn loop's steer poll)."""
        return bool(self._lines)

    def take(self) -> str | None:
        """All queued lines, joined by newlines, and empty the queue; None if empty."""
        with self._lock:
            lines, self._lines = self._lines, []
        return "\n".join(lines) if lines else None


class KeyReader:
    """Reads the terminal's keys for the whole turn (a context manager; see the module doc).

    Args:
        steer: where Enter queues lines.
        show: ``show(text)`` a status line (called on the reader thread).
        stdin: the terminal (default ``sys.stdin``).

    Attributes:
        escaped: Esc was pressed (the caller sends the queue after the turn).
        partial: the line being typed when the reader stopped.
    """

    def __init__(self, steer: SteerQueue, show: Callable[[str], None], stdin=None) -> None:
        self.steer = steer
        self.show = show
        self.escaped = False
        self.partial = ""
        self._input = create_input(stdin or sys.stdin)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._answers: queue.Queue | None = None  # set while a prompt waits for a line
        self._hidden = False  # the line being read is a secret: typed keys are not shown
        self._main = threading.main_thread().ident
        self._raw: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> KeyReader:
        self._raw = self._input.raw_mode()
        self._raw.__enter__()
        self._thread = threading.Thread(target=self._run, name="steer-keys", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._raw is not None:
            self._raw.__exit__(None, None, None)
        self._input.close()

    def read_line(
        self, show_prompt: Callable[[], None] = lambda: None, hidden: bool = False
    ) -> str:
        """The next line typed after ``show_prompt()`` put the question on screen: echoed
        as typed, unless ``hidden`` (a password). The reader answers before the prompt is
        shown: a key typed once the prompt is visible (a Ctrl+D at once) is never taken
        for one typed before it.

        Raises:
            EOFError: Ctrl+D.
            KeyboardInterrupt: Ctrl+C or Esc (the agent's SIGINT handler raises it).
        """
        answers: queue.Queue = queue.Queue()
        kept, self.partial = self.partial, ""
        self._hidden = hidden
        self._answers = answers
        try:
            show_prompt()
            while True:
                with contextlib.suppress(queue.Empty):
                    got = answers.get(timeout=0.1)  # short waits: a signal gets through
                    if got is _EOF:
                        raise EOFError
                    return got
        finally:
            self._answers = None
            self._hidden = False
            self.partial = kept

    # ---- the reader thread

    def _run(self) -> None:
        fd = self._input.fileno()
        while not self._stop.is_set():
            try:
                ready = select.select([fd], [], [], _POLL_S)[0]
            except (OSError, ValueError):
                return
            keys = self._input.read_keys() if ready else self._input.flush_keys()
            for kp in keys:
                self._key(kp.key, kp.data)

    def _echo(self, text: str, typed: bool = True) -> None:
        """Show ``text`` while a question is answered; a hidden answer's ``typed``
        characters (and their erasing) are not shown."""
        if self._answers is not None and not (typed and self._hidden):
            os.write(sys.stdout.fileno(), text.encode())

    def _key(self, key, data: str) -> None:
        answers = self._answers
        if key in (Keys.ControlM, Keys.ControlJ):
            line, self.partial = self.partial, ""
            if answers is not None:
                self._echo("\r\n", typed=False)
                answers.put(line)
            elif line.strip().startswith("/"):
                self.steer.commands.append(line.strip())
                self.show(f"runs when the turn ends (Ctrl+C ends it now): {line.strip()}")
            elif line.strip():
                self.steer.push(line)
                self.show(f"queued for the next boundary: {line}")
        elif key == Keys.ControlC:
            self.partial = ""
            self._interrupt()
        elif key == Keys.Escape:
            if answers is None and self.partial.strip():
                self.steer.push(self.partial)
            self.partial = ""
            self.escaped = True
            self._interrupt()
        elif key == Keys.ControlD:
            if answers is not None and not self.partial:
                answers.put(_EOF)
        elif key in (Keys.Backspace, Keys.ControlH):
            if self.partial:
                self.partial = self.partial[:-1]
                self._echo("\b \b")
        elif key == Keys.BracketedPaste or (len(data) == 1 and data.isprintable()):
            text = data.replace("\r", " ").replace("\n", " ")
            self.partial += text
            self._echo(text)

    def _interrupt(self) -> None:
        """What Ctrl+C does in a cooked terminal: SIGINT to the main thread."""
        if self._main is not None:
            signal.pthread_kill(self._main, signal.SIGINT)


@contextlib.contextmanager
def steering(agent, ui, steer: SteerQueue) -> Iterator[KeyReader | None]:
    """Around one ``agent.send`` in a terminal: the key reader runs, the turn loop polls
    ``steer``, the UI's prompts read lines from the reader. Yields None (nothing is read)
    when stdin is not a terminal."""
    if not sys.stdin.isatty():
        yield None
        return
    reader = KeyReader(steer, ui.interject)
    turns = agent.turns
    with reader:
        turns.steer_pending, turns.steer_take = steer.pending, steer.take
        ui.keys = reader
        try:
            yield reader
        finally:
            ui.keys = None
            turns.steer_pending, turns.steer_take = (lambda: False), (lambda: None)
