"""``ds4mlx agent``: load the model, wire the loop, the UI and the stores; the REPL.

Interactive mode reads messages and ``/commands`` at a prompt; ``-p TEXT`` sends one
message, shows the transcript (banner, the message, thinking, tool calls) on stderr,
prints only the final answer on stdout, and exits with 0 when the model gave a final
answer, also one cut at the per-turn token limit (``length``, a normal end: a note on
stderr says so); 1 when it was interrupted, ran out of context or of tool rounds, or
failed; 2 for usage and load errors. With ``--demo`` the per-turn cap stands in for the
EOS the noise model never samples (as ``serve --demo``'s cap does): a turn it ends is a
final answer without the note, unless ``--max-tokens`` set the limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ds4mlx.argtypes import nonempty, positive_int, positive_seconds

# Heavy imports (rich, MLX through the loop) happen inside the functions: building the
# CLI parser must stay fast (``ds4mlx --help``).
if TYPE_CHECKING:
    from ds4mlx.agent.loop import Agent
    from ds4mlx.agent.ui import RichUI

HELP = """\
commands:
  /help          this help
  /new           start a new session (the current one is saved)
  /list          list the sessions of this workspace
  /switch N      switch to session N (restored from the disk KV cache, no prefill)
  /save          save the current session (KV snapshot + transcript)
  /history       show the current session's transcript
  /think         thinking mode on for the next turns
  /nothink       thinking mode off for the next turns
  /ctx           context usage and cache state
  /quit          save and exit (also Ctrl+D; SIGTERM and SIGHUP do the same)
Ctrl+C stops the model (or a running tool) and returns to the prompt.
While the model works: type a line and Enter to steer (applied at the next boundary:
at once in its text, after a tool-call block; calls not started are skipped); Esc stops
at once and sends what is queued; a question on screen takes the next line typed; a
/command typed then runs when the turn ends."""


def default_kv_dir() -> Path:
    """``$XDG_CACHE_HOME/ds4mlx/agent-kv`` (``~/.cache/…`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ds4mlx" / "agent-kv"


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add the ``agent`` subcommand's arguments to ``p`` (its help lists the commands)."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "interactive " + HELP
    p.add_argument("-m", "--model", default=None, help="checkpoint directory ($DS4MLX_MODEL)")
    p.add_argument(
        "--demo", action="store_true", help="use the tiny demo model (random weights: noise)"
    )
    p.add_argument(
        "-p", "--prompt", type=nonempty, default=None, help="send one message, print, exit"
    )
    p.add_argument("--yes", action="store_true", help="allow write/edit/bash without asking")
    p.add_argument("--ctx", type=positive_int, default=None, help="context size in tokens")
    p.add_argument("--workspace", default=None, help="directory the tools work in (cwd)")
    p.add_argument(
        "--kv-disk-dir",
        default=None,
        help=f"disk KV cache + sessions directory (default {default_kv_dir()})",
    )
    p.add_argument(
        "--kv-disk-space-mb", type=int, default=4096, help="disk KV budget in MiB (4096)"
    )
    p.add_argument("--nothink", action="store_true", help="start with thinking mode off")
    p.add_argument("--temp", type=float, default=1.0, help="temperature (1.0)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p (0.05)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument(
        "--max-tokens", type=int, default=None, help="most tokens per model turn (the context)"
    )
    p.add_argument("--max-steps", type=int, default=100, help="most tool rounds per message")
    p.add_argument(
        "--tool-output-tokens",
        type=int,
        default=None,
        help="token budget of one tool result (ctx/8, at most 4096)",
    )
    p.add_argument(
        "--bash-timeout",
        type=positive_seconds,
        default=120.0,
        help="foreground command timeout, s (120)",
    )
    p.add_argument(
        "--job-timeout",
        type=positive_seconds,
        default=3600.0,
        metavar="S",
        help="background job deadline when the call sets none, s (3600)",
    )
    p.add_argument(
        "--job-output-limit-mb",
        type=float,
        default=64.0,
        metavar="MB",
        help="a background job printing more than this (MiB) is stopped (64)",
    )
    p.add_argument("--hide-thinking", action="store_true", help="do not stream the reasoning")
    p.add_argument(
        "--pass-env",
        action="append",
        default=[],
        metavar="NAME",
        help="pass this variable to commands although it looks secret (its name holds KEY, "
        "SECRET, TOKEN, PASSWORD, PASSWD or CREDENTIAL, or its value is a URL with a "
        "password) (repeatable; also $DS4MLX_AGENT_PASS_ENV, comma-separated)",
    )
    p.add_argument(
        "--inherit-env",
        action="store_true",
        help="commands get the whole environment (default: secret-looking names withheld)",
    )
    p.add_argument(
        "--before-response-hook",
        default=None,
        metavar="CMD",
        help="run CMD (bash) before every assistant response, the turn as JSON on stdin "
        "(observe only)",
    )
    p.add_argument(
        "--after-response-hook",
        default=None,
        metavar="CMD",
        help="run CMD (bash) after every assistant response, its text as JSON on stdin",
    )
    p.add_argument(
        "--hook-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds a hook may run before it is killed (10; 1..3600)",
    )
    p.add_argument(
        "--mcp-config",
        default=None,
        metavar="FILE",
        help="MCP servers (Claude Code's mcpServers JSON; default: .mcp.json in the workspace)",
    )
    p.add_argument(
        "--mcp-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds an MCP server may take to start, or a call to answer (60)",
    )
    # Tests only: a JSON list of completion texts, one per model turn (scripted decoding).
    p.add_argument("--script-file", default=None, help=argparse.SUPPRESS)


def _load_script(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
        raise ValueError("script file must hold a JSON list of strings")
    return data


def _mcp_config(args: argparse.Namespace, workspace: Path):
    """The MCP configuration: ``--mcp-config FILE``, else the workspace's ``.mcp.json``
    (started only once approved: `ds4mlx.agent.mcp_trust`), else None.

    Raises:
        ValueError: unreadable or malformed config, or ``--mcp-timeout`` not positive.
    """
    from ds4mlx.agent.mcp import McpConfigError, load_config

    if not args.mcp_timeout > 0:
        raise ValueError(f"--mcp-timeout must be positive, got {args.mcp_timeout:g}")
    path = Path(args.mcp_config) if args.mcp_config else workspace / ".mcp.json"
    if not args.mcp_config and not path.exists():
        return None
    try:
        return load_config(path)
    except McpConfigError as e:
        raise ValueError(str(e)) from None


def _start_mcp(config, args: argparse.Namespace, workspace: Path, env_policy, warn, log_dir, ask):
    """Start the configured MCP servers and discover their tools (before the first prompt,
    so they are in the cached prefix); a server that fails is a warning. None without a
    config, or for the workspace's own file until the user approves it (``ask``: the UI's
    permission question, None without a terminal; `ds4mlx.agent.mcp_trust`). Servers'
    stderr goes to ``log_dir/mcp-servers.log`` (discarded if unwritable).
    """
    if config is None:
        return None
    from ds4mlx.agent.mcp import McpClient
    from ds4mlx.agent.mcp_trust import approve

    if not args.mcp_config and not approve(config, workspace / ".mcp.json", ask, warn):
        return None

    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        log = open(log_dir / "mcp-servers.log", "a", encoding="utf-8")  # noqa: SIM115
    except OSError:
        log = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
    client = McpClient(
        config, cwd=workspace, env_policy=env_policy, timeout=args.mcp_timeout, log=log, warn=warn
    )
    client.start()
    return client


def _run_config(args: argparse.Namespace, workspace: Path):
    """``(script, env_policy, hooks, mcp_config)`` from the flags, checked before the
    model loads.

    Raises:
        ValueError: a bad ``--script-file``, ``--hook-timeout``, ``--mcp-timeout`` or MCP
            config (the message says which).
    """
    from ds4mlx.agent.child_env import EnvPolicy
    from ds4mlx.agent.hooks import Hooks

    script = None
    if args.script_file:
        try:
            script = _load_script(args.script_file)
        except (OSError, ValueError) as e:
            raise ValueError(f"bad --script-file: {e}") from None
    for flag, value in (
        ("--job-timeout", args.job_timeout),
        ("--job-output-limit-mb", args.job_output_limit_mb),
    ):
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value:g}")
    env_policy = EnvPolicy.from_config(inherit=args.inherit_env, passed=args.pass_env)
    hooks = Hooks(
        before=args.before_response_hook,
        after=args.after_response_hook,
        timeout=args.hook_timeout,
        cwd=workspace,
        env_policy=env_policy,
    )
    return script, env_policy, hooks, _mcp_config(args, workspace)


def run(args: argparse.Namespace) -> int:
    """Run ``ds4mlx agent`` with parsed ``args``; returns the exit code."""
    from ds4mlx.agent.loop import Agent
    from ds4mlx.agent.ui import RichUI, SafeConsole

    # One line per message however long (paths), never read as rich markup.
    err = SafeConsole(stderr=True, highlight=False, soft_wrap=True, markup=False)
    model = args.model or os.environ.get("DS4MLX_MODEL")
    if args.demo:
        if args.model:
            err.print("ds4mlx agent: give either --model or --demo, not both")
            return 2
        from ds4mlx.model.demo import demo_model_dir, ensure_demo_model

        if not (demo_model_dir() / "config.json").is_file():
            err.print(f"making the tiny demo model in {demo_model_dir()} (once)…")
        model = str(ensure_demo_model())
    if not model:
        err.print("ds4mlx agent: no model: give -m DIR (or $DS4MLX_MODEL) or --demo")
        return 2
    workspace = Path(args.workspace or os.getcwd()).resolve()
    if not workspace.is_dir():
        err.print(f"ds4mlx agent: workspace {workspace} is not a directory")
        return 2
    try:
        script, env_policy, hooks, mcp_config = _run_config(args, workspace)
    except ValueError as e:
        err.print(f"ds4mlx agent: {e}")
        return 2

    from ds4mlx.agent.sessions import SessionBook
    from ds4mlx.blas import blas_label
    from ds4mlx.engine import Engine, SamplingParams
    from ds4mlx.engine.speculative import speculation_for
    from ds4mlx.kv.store import DiskKVStore
    from ds4mlx.model.loading import LoadError

    try:
        sampling = SamplingParams(temperature=args.temp, min_p=args.min_p, seed=args.seed)
    except ValueError as e:
        err.print(f"ds4mlx agent: {e}")
        return 2
    try:
        engine = Engine.load(model, ctx_size=args.ctx, speculative=args.speculative)
        engine.speculation = speculation_for(engine, args.speculative, args.draft_tokens)
    except (LoadError, OSError, ValueError, RuntimeError) as e:
        err.print(f"ds4mlx agent: cannot load model {model}: {e}")
        return 2
    kv_dir = Path(args.kv_disk_dir) if args.kv_disk_dir else default_kv_dir()
    try:
        store = DiskKVStore(
            kv_dir,
            budget_bytes=max(1, args.kv_disk_space_mb) << 20,
            model_identity=engine.identity,
            ctx_size=engine.ctx_size,
            expert_bits=engine.quant.expert_bits,
        )
        book = SessionBook(kv_dir / "agent-sessions")
    except (OSError, ValueError) as e:
        err.print(f"ds4mlx agent: disk KV cache off ({kv_dir}: {e})")
        store, book = None, None

    interactive = args.prompt is None
    # -p: stdout carries only the answer (scripts read it); the transcript goes to stderr.
    console = SafeConsole(highlight=False, stderr=not interactive)
    ui = RichUI(
        console,
        can_ask=sys.stdin.isatty() or interactive,
        show_thinking=not args.hide_thinking,
    )
    from ds4mlx.model.demo import DEMO_MAX_TOKENS, demo_policy

    policy = demo_policy(args.demo, args.max_tokens)

    mcp = _start_mcp(
        mcp_config,
        args,
        workspace,
        env_policy,
        lambda m: err.print(f"warning: {m}"),
        kv_dir,
        ui.ask if ui.can_ask else None,
    )
    try:
        agent = Agent(
            engine,
            workspace,
            ui=ui,
            store=store,
            book=book,
            yes=args.yes,
            # --demo (its own cap): no thinking, or the noise model's reasoning would take
            # the whole cap and the answer would be empty (as serve --demo does).
            thinking=not args.nothink and not policy,
            sampling=sampling,
            # The demo model's text is noise that may never end a turn: keep turns short.
            max_tokens=args.max_tokens or (DEMO_MAX_TOKENS if args.demo else None),
            # ... and the cap ends a turn as an EOS would (its last token fed).
            cap_is_eos=policy,
            max_steps=args.max_steps,
            tool_output_tokens=args.tool_output_tokens,
            bash_timeout=args.bash_timeout,
            env_policy=env_policy,
            job_timeout=args.job_timeout,
            job_output_limit=int(args.job_output_limit_mb * 2**20),
            # -p: a command waiting for input gets end of file (said in its result).
            ask_input=ui.ask_input if interactive else None,
            # A foreground command's output comes with its result: say that it runs.
            on_running=lambda: ui.line("  … running (Ctrl+C stops it)", "dim"),
            script=script,
            hooks=hooks,
            mcp=mcp,
        )
    except ValueError as e:
        if mcp is not None:
            mcp.close()
        err.print(f"ds4mlx agent: {e}")
        return 2
    banner = (
        f"ds4mlx agent · {engine.path.name} ({engine.quant_desc}) · ctx {engine.ctx_size} · "
        f"BLAS {blas_label()} · workspace {workspace}"
    )
    withheld = env_policy.withheld()
    if withheld:
        banner += (
            f"\ncommands run without {', '.join(withheld)} "
            "(--pass-env NAME passes one, --inherit-env all)"
        )
    if not interactive:
        return _print_mode(agent, ui, banner, args)
    ui.line(banner, "dim")
    ui.line("type a message, /help for commands", "dim")
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    with _signals(interactive=True, exiting=True) as sig:
        try:
            return repl(agent, ui, sig, demo=policy)
        finally:
            agent.close()


def _print_mode(agent: Agent, ui: RichUI, banner: str, args: argparse.Namespace) -> int:
    """``-p``: send one message; the answer on stdout, the transcript on stderr.

    Exit status: 0 when the answer ended, also when ``--max-tokens`` (or the demo cap)
    cut a turn (``length``: a normal end, with a note on stderr); 1 when it stopped
    otherwise (the context full, ``--max-steps``, an interruption, an engine error);
    128 + N after signal N.
    """
    from ds4mlx.sanitize import escape_controls

    err = ui.console
    ui.line(banner, "dim")
    with _signals(interactive=False, exiting=True) as sig:
        try:
            ui.line(f"› {args.prompt}", "bold green")
            result = agent.send(args.prompt)
        finally:
            agent.close()
    if sig.terminating:
        return 128 + sig.terminating
    ok = result.ok
    # The answer is model text like the rest: no raw control characters on stdout either.
    answer = escape_controls(_final_answer(agent))
    if answer:
        sys.stdout.write(answer if answer.endswith("\n") else answer + "\n")
        sys.stdout.flush()
    if result.status == "length":
        err.print("ds4mlx agent: note: the answer was cut at the per-turn token limit (length)")
        return 0
    if not ok:
        err.print(f"ds4mlx agent: stopped: {result.status} {result.message}".rstrip())
    return 0 if ok else 1


def _final_answer(agent: Agent) -> str:
    """The visible text of the last assistant turn ("" when it had none)."""
    for m in reversed(agent.messages):
        if m.role == "assistant":
            return m.content or ""
    return ""


class SignalState:
    """What the agent's signal handlers saw (see :func:`_signals`).

    Attributes:
        reading: the prompt is blocked reading a line (only then does SIGINT raise, and
            only once: the raise clears it).
        prompting: the prompt is being shown (a SIGINT then is kept in ``pending`` and
            raised when the read starts, so every Ctrl+C at the prompt is answered).
        pending: a SIGINT arrived while prompting.
        interrupts: how many times the SIGINT handler ran while prompting (the watcher of
            :func:`_redeliver_until_handled` compares it to know a SIGINT was seen).
        terminating: SIGTERM or SIGHUP arrived (its number); 0 if not.
    """

    def __init__(self) -> None:
        self.reading = False
        self.prompting = False
        self.pending = False
        self.interrupts = 0
        self.terminating = 0

    @contextlib.contextmanager
    def read(self):
        """Around the blocking read of a line: SIGINT raises `KeyboardInterrupt` here."""
        # Reading first, then the check: a signal after this line raises from its handler,
        # one before it left ``pending`` (SIGINT) or ``terminating`` (SIGTERM/SIGHUP, which
        # must not leave the agent blocked in a read nobody will answer).
        self.reading = True
        if self.pending or self.terminating:
            self.pending = self.reading = False
            raise KeyboardInterrupt  # from plain code, not inside a signal handler
        try:
            yield
        finally:
            self.reading = False


@contextlib.contextmanager
def _signals(*, interactive: bool, exiting: bool = False):
    """Install the REPL's SIGINT handler and a SIGTERM/SIGHUP handler; yield their state.

    SIGINT at the prompt interrupts only the line being read. Anywhere else outside a
    model turn (printing, ``/commands``, the final save) it is dropped: a second or
    forwarded SIGINT (a wrapper such as ``timeout`` re-sends the terminal's to its child
    and its process group) must not kill the agent mid-print or mid-save. During a turn
    the agent installs its own handler (stop generation / stop the running tool).

    SIGTERM and SIGHUP work like ``/quit``: they interrupt what runs (as Ctrl+C would),
    then the REPL returns and the caller saves the session and stops background jobs.
    After SIGHUP the terminal is gone; output goes to ``/dev/null`` from then on.

    The SIGINT handler raises at most once per read, and never while it is raising:
    a second SIGINT that arrives while Python builds the first ``KeyboardInterrupt``
    runs the handler again inside that call, and a second raise there turned into
    ``SystemError: <class 'KeyboardInterrupt'> returned a result with an exception
    set`` (a crash under a double Ctrl+C). With ``exiting`` (the process ends after the
    block) SIGINT stays ignored afterwards, so a late copy cannot raise inside the
    interpreter's exit handlers (``weakref.finalize`` at exit).
    """
    state = SignalState()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return

    def on_int(signum, frame):
        if state.prompting:
            state.interrupts += 1
        if state.reading:
            state.reading = False  # first: a nested call (see above) must not raise
            raise KeyboardInterrupt
        if state.prompting:
            state.pending = True

    def on_term(signum, frame):
        first = not state.terminating
        state.terminating = state.terminating or signum
        if signum == signal.SIGHUP:
            _detach_terminal()
        if not first:
            return
        handler = signal.getsignal(signal.SIGINT)  # the agent's during a turn, else ours
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    prev = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    if interactive:
        signal.signal(signal.SIGINT, on_int)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    try:
        # Inside the handlers' lifetime: the watcher re-sends only while on_term is installed.
        with _redeliver_until_handled(state, interactive=interactive):
            yield state
    finally:
        # Exiting, SIGINT goes straight from ours to ignored: CPython runs the handler
        # installed when it checks, so a SIGINT that arrived under ours but was checked
        # after the default handler came back raised KeyboardInterrupt on the way out.
        if exiting:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        for s, h in prev.items():
            if not (exiting and s == signal.SIGINT):
                signal.signal(s, h)


_REDELIVER_S = 0.05


@contextlib.contextmanager
def _redeliver_until_handled(state: SignalState, *, interactive: bool):
    """Re-send a signal to the main thread until its Python handler has run.

    CPython runs a Python signal handler only in the main thread, when the interpreter
    next checks; a main thread blocked in C learns of a signal only from ``EINTR``. The
    prompt's ``input()`` blocks in readline's ``select`` with no timeout, so a signal was
    lost when it arrived after the interpreter's last check but before ``select``
    started, or when the kernel handed it to another thread (it may pick any thread that
    does not block the signal, e.g. when the main thread already has one pending). For
    SIGTERM the agent stayed at the prompt; for SIGINT the handler ran only when the
    next line arrived, and cancelled that line. Python's wakeup fd records every signal
    whichever thread took it: a watcher thread reading it re-sends the signal to the
    main thread (``pthread_kill``, interrupting the ``select``):

    - SIGTERM/SIGHUP every ``_REDELIVER_S`` s until ``state.terminating`` shows the
      handler ran;
    - SIGINT (``interactive`` only) that came while prompting once, after
      ``_REDELIVER_S`` s, if the read still blocks and the handler has not run since.
      The watcher drains the fd and decides once per batch (a burst is one decision,
      made on fresh state). The re-sent copies write the fd too; the watcher skips as
      many SIGINT bytes as it sent, so a re-send never triggers another.

    Must be entered on the main thread, while the handlers are installed.
    """
    r, w = os.pipe()
    os.set_blocking(w, False)  # set_wakeup_fd requires it
    os.set_blocking(r, False)  # the watcher drains what is there, then waits in select
    prev_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    done = threading.Event()
    main = threading.main_thread().ident
    terminating = (signal.SIGTERM, signal.SIGHUP)

    def interrupt_read() -> int:
        """One SIGINT at the prompt: re-send it if the main thread never saw it."""
        if not (state.prompting or state.reading):
            return 0  # a turn's handler or nobody's: not the prompt's to answer
        seen = state.interrupts
        if done.wait(_REDELIVER_S) or not state.reading or state.interrupts != seen:
            return 0
        signal.pthread_kill(main, signal.SIGINT)
        return 1

    def batch() -> bytes | None:
        """Every byte written so far (waits for the first one); None at EOF."""
        select.select([r], [], [])
        out = b""
        while True:
            try:
                chunk = os.read(r, 4096)
            except BlockingIOError:
                return out
            if not chunk:
                return out or None
            out += chunk

    def watch() -> None:
        owed = 0  # SIGINT bytes this watcher caused itself
        while (data := batch()) is not None:
            # One decision per batch, on fresh state: a burst's bytes judged one by one,
            # each after the last one's wait, were judged seconds late, against a read
            # that began after them, and the re-send cancelled a line typed meanwhile.
            ints = data.count(signal.SIGINT) if interactive else 0
            paid = min(owed, ints)
            owed -= paid
            if ints > paid:
                owed += interrupt_read()
            sig = next((s for s in data if s in terminating), None)
            # Each re-send writes the wakeup fd again; the loop below already covers it.
            while sig is not None and not state.terminating and not done.wait(_REDELIVER_S):
                if not state.terminating:
                    signal.pthread_kill(main, sig)

    watcher = threading.Thread(target=watch, name="signal-redeliver", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(prev_fd)
        done.set()
        os.close(w)  # the watcher reads EOF and ends
        watcher.join()
        os.close(r)


def _detach_terminal() -> None:
    """Point stdin/stdout/stderr at ``/dev/null`` (the terminal hung up)."""
    try:
        fd = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    for target in (0, 1, 2):
        with contextlib.suppress(OSError):
            os.dup2(fd, target)
    os.close(fd)


def repl(agent: Agent, ui: RichUI, sig: SignalState | None = None, *, demo: bool = False) -> int:
    """Read messages and commands until ``/quit`` or end of input; returns 0.

    With ``sig`` (see :func:`_signals`): returns ``128 + N`` once signal N (SIGTERM,
    SIGHUP) asked the agent to exit.
    """
    from ds4mlx.agent.idle import idle_notices

    sig = sig or SignalState()
    while True:
        if sig.terminating:
            name = signal.Signals(sig.terminating).name
            ui.line(f"({name}: saving the session and exiting)", "yellow")
            return 128 + sig.terminating
        try:
            sig.prompting, sig.pending = True, False
            try:
                # A background job that ends meanwhile is shown at once (sent later).
                with idle_notices(agent.turns.notices, ui.interject):
                    line = ui.read_line(guard=sig.read())
            finally:
                sig.prompting = False
        except EOFError:
            ui.line("")
            return 0
        except KeyboardInterrupt:
            if not sig.terminating:
                ui.line("(Ctrl+C: /quit or Ctrl+D to exit)", "dim")
            continue
        text = line.strip()
        if not text:
            continue
        commands = [text] if text.startswith("/") else send_steerable(agent, ui, line)
        for cmd in commands:
            if command(agent, ui, cmd, demo=demo) == "quit":
                return 0


def send_steerable(agent: Agent, ui: RichUI, line: str) -> list[str]:
    """Send ``line`` with the steering key reader running (``ds4mlx.agent.steer``): lines
    typed meanwhile are applied at the turn's next boundary; what is still queued when
    the message's turns end (Esc, or typed as the last turn finished) is sent next. After
    Ctrl+C the queue is dropped (said). Returns the ``/commands`` typed meanwhile, for
    the prompt to run in order."""
    from ds4mlx.agent.steer import SteerQueue, steering

    steer = SteerQueue()
    text: str | None = line
    while text:
        with steering(agent, ui, steer) as keys:
            result = agent.send(text)
        text = steer.take()
        if text and result.status == "interrupted" and not (keys and keys.escaped):
            ui.notice(f"dropped after Ctrl+C: {text}", "warn")
            break
        if text:
            ui.line(f"› {text}", "bold green")
    return steer.commands


def _switch(agent: Agent, ui: RichUI, arg: str) -> None:
    """``/switch N``: make session N current; say its thinking mode when it changed."""
    if not arg.isdigit():
        ui.notice("usage: /switch N (see /list)", "warn")
        return
    before = agent.record.id if agent.record else None
    ui.line(agent.switch(int(arg)), "green")
    if agent.record is not None and agent.record.id != before:
        # The session keeps the thinking mode it was recorded with.
        ui.line(f"thinking {'on' if agent.thinking else 'off'} for this session", "dim")


def command(agent: Agent, ui: RichUI, text: str, *, demo: bool = False) -> str | None:
    """Run one ``/command``; returns ``"quit"`` for ``/quit``. ``demo``: the demo policy
    applies (``ds4mlx.model.demo.demo_policy``), so ``/think`` keeps thinking off."""
    from ds4mlx.agent.loop import AgentError

    name, _, arg = text.partition(" ")
    arg = arg.strip()
    try:
        if name in ("/quit", "/exit", "/q"):
            return "quit"
        if name == "/help":
            ui.line(HELP)
        elif name == "/new":
            agent.new_session()
            ui.line("new session", "dim")
        elif name == "/list":
            ui.show_sessions(agent.sessions(), agent.record.id if agent.record else None)
        elif name == "/switch":
            _switch(agent, ui, arg)
        elif name == "/save":
            rec = agent.save("continued")
            if rec is None:
                ui.notice("nothing to save yet", "warn")
            else:
                snap = f"{rec.kv_tokens} tokens" if rec.kv_key else "no KV snapshot"
                ui.line(f"saved session {rec.id} ({snap})", "green")
        elif name == "/history":
            ui.show_history(agent.messages)
        elif name == "/think" and demo:
            from ds4mlx.model.demo import DEMO_NO_THINKING

            ui.notice(f"thinking stays off: {DEMO_NO_THINKING}", "warn")
        elif name == "/think":
            agent.set_thinking(True)
            ui.line("thinking on", "dim")
        elif name == "/nothink":
            agent.set_thinking(False)
            ui.line("thinking off", "dim")
        elif name == "/ctx":
            st = agent.status()
            pct = 100.0 * st.used / st.ctx
            ui.line(
                f"context {st.used}/{st.ctx} tokens ({pct:.1f}%), soft compaction at "
                f"{agent.policy.soft_limit(st.ctx)}; KV {st.kv_bytes / 2**20:.2f} MiB; "
                f"live state: {agent.state}; transcript re-renders exactly: "
                f"{'yes' if agent.exact else 'no'}; compactions: {len(agent.compactions)}"
            )
        else:
            ui.notice(f"unknown command {name}; /help lists them", "warn")
    except AgentError as e:
        ui.notice(str(e), "warn")
    return None
