"""``ds4mlx serve``: flags → `ServerConfig`, load the model, serve until stopped."""

from __future__ import annotations

import atexit
import logging
import os
import signal
from dataclasses import dataclass

from ds4mlx.model.demo import (
    DEMO_CTX,
    DEMO_MAX_TOKENS,
    demo_model_dir,
    demo_policy,
    ensure_demo_model,
)
from ds4mlx.server.app import serve, start_worker
from ds4mlx.server.config import ServerConfig

NO_MODEL_MESSAGE = """\
ds4mlx serve: no model given.

  Serve a converted DeepSeek V4 Flash checkpoint directory (config.json + *.safetensors):
      ds4mlx serve -m ~/models/ds4-flash-q2      (or set DS4MLX_MODEL)
  Get one (README "Run the real model on a Mac"; `ds4mlx doctor` says which build fits
  this machine: the one below needs a 128 GB Mac):
      hf download deepseek-ai/DeepSeek-V4-Flash --local-dir ~/models/DeepSeek-V4-Flash
      ds4mlx convert ~/models/DeepSeek-V4-Flash ~/models/ds4-flash-q2 \\
          --expert-bits 2 --group-size 128 --bits mxfp8

  Or try the server right now on the tiny demo model (random weights, real tokenizer
  and protocols; its text is noise):
      ds4mlx serve --demo
"""


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (in use, no such address), or None.

    Checked before the model loads, which takes minutes with a real checkpoint: a busy
    port must not be found only after that. The probe socket sets ``SO_REUSEADDR`` as
    Hypercorn's own does, so a port in TIME_WAIT passes and a listening one fails.
    """
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        return f"{getattr(e, 'strerror', None) or e} (check --host)"
    family, kind, proto, _, addr = infos[0]
    try:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        why = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            return f"{why} (another server there? pick one with --port)"
        if e.errno == errno.EADDRNOTAVAIL:
            return f"{why} (no such address on this machine: check --host)"
        return why
    return None


class Refused(Exception):
    """``serve`` cannot start with these flags: ``line`` says why (printed after
    ``ds4mlx serve:``; None when another rank says it), ``code`` is the exit code."""

    def __init__(self, line: str | None, code: int = 2):
        super().__init__(line)
        self.line, self.code = line, code


def run_serve(args, register) -> int:
    """``ds4mlx serve``: load the model (or make the demo one) and serve until stopped.

    ``register(app)`` adds the routes (``ds4mlx.routes.register``; the command line
    chooses them: the server imports no route module). Every flag that needs no weights
    is checked first, on every rank of a ``--distributed`` launch, which share their
    refusals before anything else (`ds4mlx.engine.rankfit.share_refusal`): one line,
    rank 0's, and the same exit code everywhere."""
    import sys

    from ds4mlx.engine.pipeline import launched_rank, launched_ranks

    _log_to_stderr(args)
    # In a launch of several ranks every rank checks the flags, and only rank 0 says
    # why it refuses (without --distributed they all refuse: `distributed_split`).
    rank = launched_rank() if args.distributed or launched_ranks() > 1 else 0
    try:
        plan = _checked(args, rank)
    except Refused as e:
        if e.line is not None:
            print(f"ds4mlx serve: {e.line}", file=sys.stderr)
        return e.code
    if rank > 0:
        return _follow(args, plan.model, plan.split)
    return _serve(args, plan.model, plan, register)


def _log_to_stderr(args) -> None:
    from ds4mlx.sanitize import LogFormatter

    # Log lines quote what clients send (paths, ids, schema keys): escaped, so a
    # request cannot write a terminal escape sequence into the operator's terminal.
    handler = logging.StreamHandler()
    # Dated (ISO 8601, one word: scripts split a line at its first space): a server runs
    # for days, and its log is read after the fact.
    handler.setFormatter(LogFormatter("%(asctime)s %(message)s", datefmt="%Y-%m-%dT%H:%M:%S"))
    logging.basicConfig(
        level=logging.WARNING if getattr(args, "quiet", False) else logging.INFO,
        handlers=[handler],
    )
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)


@dataclass
class _Plan:
    """What the checked flags give: the split, the disk cache settings, why
    ``--sessions`` is what it is, and (rank 0) the server's config."""

    model: str
    split: list[int] | None
    kv: object = None
    config: ServerConfig | None = None


def _checked(args, rank: int) -> _Plan:
    """The flags checked (`_plan`), on every rank; under ``--distributed`` the ranks'
    refusals are shared first, so a rank refuses when any does.

    Raises:
        Refused: this rank's, or (``line`` None on a rank > 0) another rank's.
    """
    from ds4mlx.engine.rankfit import share_refusal

    try:
        plan, mine = _plan(args, rank), None
    except Refused as e:
        plan, mine = None, e
    if not (args.distributed or "MLX_RANK" in os.environ):
        if mine is not None:
            raise mine
        return plan
    shared = share_refusal(mine.code if mine else 0, args.rank_timeout)
    if shared is None:
        return plan
    first, code = shared
    if mine is not None and (rank == 0 or first > 0):
        raise mine  # rank 0 says why; a follower says its own only when rank 0 is fine
    raise Refused(None if rank > 0 else f"rank {first} refused to start (it says why)", code)


def _plan(args, rank: int) -> _Plan:
    """Find the model (`_model_dir`) and check every flag that needs no weights (rank 0
    also the port and ``--trace`` path, which only it uses).

    Raises:
        Refused: no model (its message printed: ``line`` None), a bad flag (code 2),
            or a port already taken (code 1).
    """
    from ds4mlx.engine.pipeline import PipelineError, distributed_split

    if rank == 0 and args.trace and (problem := _trace_problem(args.trace)):
        raise Refused(f"--trace {args.trace}: {problem}")
    model = _model_dir(args)
    if model is None:
        raise Refused(None)
    try:
        split = distributed_split(args.distributed, args.pipeline_split, args.speculative)
    except PipelineError as e:
        raise Refused(str(e)) from None
    if rank == 0 and (busy := port_problem(args.host, args.port)) is not None:
        raise Refused(f"cannot listen on {args.host}:{args.port}: {busy}", 1)
    if args.tokens is not None and args.tokens < 1:
        raise Refused("--tokens must be >= 1")
    if args.tool_memory_max_ids < 1:
        raise Refused("--tool-memory-max-ids must be >= 1")
    if args.max_connections is not None and args.max_connections < 1:
        raise Refused("--max-connections must be >= 1")
    from ds4mlx.origins import api_keys_from

    try:
        _ctx_problem(args.ctx, model)
        kv, sessions_why = _kv_settings(args, model, split)
        api_keys = api_keys_from(args.api_key, os.environ.get("DS4MLX_API_KEY"))
        origins = _origins(args.allowed_origin)
    except ValueError as e:
        raise Refused(str(e)) from None
    if rank > 0:
        return _Plan(model, split, kv)
    return _Plan(model, split, kv, _config(args, kv, sessions_why, api_keys, origins))


def _ctx_problem(ctx: int | None, model: str) -> None:
    """Refuse ``--ctx`` beyond the model's positions before its weights load (the same
    check as the engine's, `ds4mlx.engine.core.check_ctx_size`).

    Raises:
        ValueError: out of range (the message). A config that cannot be read is left
            to the load, which says why.
    """
    if ctx is None:
        return
    from ds4mlx.engine.core import check_ctx_size, max_positions_of
    from ds4mlx.model.checkpoint import read_config

    try:
        config = read_config(model)
    except Exception:  # noqa: BLE001 - the load reports a bad checkpoint with its reason
        config = {}
    check_ctx_size(ctx, max_positions_of(None, config))


def _config(args, kv, sessions_why, api_keys, origins) -> ServerConfig:
    """Rank 0's `ServerConfig` from the checked flags."""
    cap = (args.tokens or DEMO_MAX_TOKENS) if args.demo else None
    return ServerConfig(
        model_name=args.served_model_name,
        default_max_tokens=cap if args.demo else args.tokens,
        max_tokens_cap=cap,
        demo_policy=demo_policy(args.demo, args.tokens),
        api_keys=api_keys,
        cors=args.cors,
        allowed_origins=tuple(origins),
        allowed_hosts=tuple(h.strip() for h in args.allowed_host if h.strip()),
        max_connections=args.max_connections,
        trace_path=args.trace,
        scripted=args.enable_scripted_decoding,
        keep_billing_header=args.keep_billing_header,
        keepalive_s=args.keepalive,
        host=args.host,
        port=args.port,
        kv=kv,
        sessions_why=sessions_why,
        tool_memory_max_ids=args.tool_memory_max_ids,
        exact_dsml_replay=not args.disable_exact_dsml_tool_replay,
        tool_call_dispatch=args.enable_streaming_tool_dispatch,
        grammar_compile_ms=args.grammar_compile_ms,
    )


def _serve(args, model: str, plan: _Plan, register) -> int:
    """Rank 0 (or the one process): load the model on the worker thread and serve."""
    import sys

    from ds4mlx.server.connections import raise_open_file_limit

    raise_open_file_limit()  # every client connection holds a descriptor
    config = plan.config
    # Ignored while the ranks checked their flags (`ds4mlx.cli.main`): from here
    # SIGTERM (mlx.launch's, or its death signal) stops rank 0.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        engine, worker = start_worker(_loader(args, model, plan.kv.sessions, plan.split), config)
    except Exception as e:  # LoadError, TokenizerError, OSError, ValueError…
        print(f"ds4mlx serve: cannot load model {model}: {e}", file=sys.stderr)
        if args.distributed:
            # Our ring sockets close before this process has finished exiting, so the
            # other ranks exit first and mlx.launch SIGTERMs us: the refusal's exit code
            # (2) must not turn into a kill's (-15) under load.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return 2
    try:
        return serve(engine, config, worker, register)
    except OSError as e:
        print(f"ds4mlx serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1


def _follow(args, model: str, split: list[int] | None) -> int:
    """A rank > 0: run its layers for rank 0 until shutdown (0); a refusal while loading
    (its line printed) is 2, a lost rank 0 is 1, as on rank 0."""
    import sys

    from ds4mlx.engine.distributed import load_distributed
    from ds4mlx.model.errors import LoadError

    try:
        # Ranks > 0 run their layers for rank 0 and never listen; they keep their parts
        # of rank 0's disk snapshots in the same --kv-disk-dir path.
        load_distributed(
            model,
            ctx_size=args.ctx,
            split=split,
            mode=args.distributed,
            parts=_part_store(args),
            rank_timeout=args.rank_timeout,
        )
    except (LoadError, ValueError, OSError) as e:  # PipelineError is a ValueError
        print(f"ds4mlx serve: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # PeerLost, the ring's error: rank 0 is gone
        print(f"ds4mlx serve: {e}", file=sys.stderr)
        return 1
    return 0


def _origins(given: list[str]) -> list:
    """``--allowed-origin`` values as origin keys. Raises ValueError naming a value that
    is not an origin."""
    from ds4mlx.origins import origin_key

    keys = []
    for o in given:
        key = origin_key(o)
        if key is None:
            raise ValueError(f"--allowed-origin {o!r} is not an origin (scheme://host[:port])")
        keys.append(key)
    return keys


def _model_dir(args) -> str | None:
    """The checkpoint to serve: ``-m``/``$DS4MLX_MODEL``, or the demo model (made once;
    its context then defaults to ``DEMO_CTX``). None after printing why there is none."""
    import sys

    model = args.model or os.environ.get("DS4MLX_MODEL")
    if args.demo:
        if model:
            print("ds4mlx serve: give either --model or --demo, not both", file=sys.stderr)
            return None
        from rich.console import Console

        path = demo_model_dir()
        if not (path / "config.json").is_file():
            Console(stderr=True).print(f"making the tiny demo model in {path} (once)…")
        model = str(ensure_demo_model(path))
        if args.ctx is None:
            args.ctx = DEMO_CTX
    if not model:
        print(NO_MODEL_MESSAGE, file=sys.stderr, end="")
        return None
    return model


def _kv_settings(args, model: str, split: list[int] | None = None):
    """``(KVCacheSettings, sessions_why)`` from the flags: ``--sessions`` resolved
    (`_default_sessions`).

    Raises:
        ValueError: a bad value, or more sessions than memory holds (the message).
    """
    from ds4mlx.kv.policy import KVCacheSettings

    # Under --distributed no rank holds the whole model: each checks its own part
    # against its own memory when the split is known (`ds4mlx.engine.rankfit`).
    whole = args.sessions if not args.distributed or (args.sessions or 1) < 1 else None
    refused = _sessions_refusal(whole, model, args.ctx)
    if refused is not None:
        raise ValueError(refused)
    kv, sessions_why = _default_sessions(KVCacheSettings.from_args(args), args, model, split)
    if args.kv_disk_space_mb is not None and kv.disk_dir is None:
        logging.getLogger("ds4mlx.server").warning(
            "--kv-disk-space-mb %d has no effect: --kv-disk-dir none turns the disk cache off",
            args.kv_disk_space_mb,
        )
    if kv.enabled and kv.disk_dir is not None:
        from ds4mlx.fsutil import private_dir
        from ds4mlx.kv.store import cache_file

        # Made (or checked) before the model loads: a folder that cannot be made is the
        # flag's fault, said at once, not a failure to load the model minutes later.
        try:
            private_dir(kv.disk_dir, ours=cache_file)
        except OSError as e:
            raise ValueError(f"--kv-disk-dir {kv.disk_dir!r}: {e.strerror or e}") from None
    return kv, sessions_why


def _part_store(args):
    """A rank > 0's maker of its store of snapshot parts (``ds4mlx.kv.parts``) in the
    ``--kv-disk-dir``, or None when the disk cache is off."""
    from ds4mlx.kv.policy import KVCacheSettings

    kv = KVCacheSettings.from_args(args)
    if not kv.enabled or kv.disk_dir is None:
        return None
    from ds4mlx.kv.parts import PartStore

    return lambda rank: PartStore(kv.disk_dir, rank)


def _loader(args, model: str, sessions: int, split: list[int] | None):
    """The engine loader the worker thread runs: one process, or rank 0 of a split."""
    from ds4mlx.engine import Engine
    from ds4mlx.engine.speculative import speculation_for

    def load():
        if not args.distributed:
            engine = Engine.load(
                model,
                ctx_size=args.ctx,
                sessions=sessions,
                speculative=args.speculative,
            )
        else:
            from ds4mlx.engine.distributed import load_distributed

            engine = load_distributed(
                model,
                ctx_size=args.ctx,
                sessions=sessions,
                split=split,
                mode=args.distributed,
                rank_timeout=args.rank_timeout,
            )
            # The followers exit when rank 0 says so, at exit: the worker has stopped then.
            atexit.register(engine.model.shutdown)
        # --speculative (ValueError for a drafter the checkpoint lacks: refused at start).
        engine.speculation = speculation_for(engine, args.speculative, args.draft_tokens)
        return engine

    return load


def _sessions_refusal(n: int | None, model: str, ctx: int | None) -> str | None:
    """Why an explicit ``--sessions n`` cannot be served, with the fit check's numbers
    (`ds4mlx.model.fit.sessions_that_fit`), or None (absent, or it fits). ``n`` < 1, or
    more resident states than the memory budget holds after the weights at ``ctx``."""
    if n is None:
        return None
    from dataclasses import replace

    from ds4mlx.model.fit import sessions_that_fit

    try:
        most, report = sessions_that_fit(model, ctx, cap=max(n, 1 << 20))
    except Exception:  # not even one fits, a bad config: the load says why, with numbers
        return None if n >= 1 else f"--sessions {n}: at least one resident state is needed"
    if n < 1:
        return (
            f"--sessions {n}: at least one resident state is needed; memory holds {most}: "
            f"{report.describe()}"
        )
    if n > most:
        return (
            f"--sessions {n} does not fit: {replace(report, sessions=n).describe()}. "
            f"Memory holds {most} at this context (--sessions {most}, or a smaller --ctx; "
            "override the budget with --memory-limit)"
        )
    return None


def _default_sessions(kv, args, model: str, split: list[int] | None = None):
    """``(settings, why)``: ``kv`` with ``--sessions`` resolved. Given, it is kept
    (`_sessions_refusal` refused it already when memory cannot hold it); absent, it is
    min(4, what the memory budget holds after the weights), at least 1
    (`ds4mlx.model.fit.sessions_that_fit`); under ``--distributed`` after each rank's
    part instead (``split``; the fewest over the ranks, on this machine's budget)."""
    from dataclasses import replace

    from ds4mlx.model.errors import LoadError
    from ds4mlx.model.fit import DEFAULT_SESSIONS, sessions_that_fit

    if args.sessions is not None:
        return kv, "--sessions"
    try:
        # The drafter --speculative loads (MTP or DSpark, Engine.load) counts too.
        from ds4mlx.model.checkpoint import read_config
        from ds4mlx.model.config import ModelArgs

        margs = ModelArgs.from_dict(read_config(model))
        drafter = args.speculative in ("auto", margs.drafter)
        parts = _rank_parts(args.distributed, margs.n_layers, split)
        n, report = min(
            (sessions_that_fit(model, args.ctx, mtp=drafter, part=part) for part in parts),
            key=lambda fit: fit[0],
        )
    except (LoadError, OSError, ValueError, KeyError, TypeError) as e:
        # FitError, a bad or missing config: the load reports it with its numbers. (Not
        # every exception: a mistake here must not pass for a model that does not fit.)
        logging.getLogger("ds4mlx.server").debug("default --sessions: %s", e)
        return kv, "default"
    kv = replace(kv, sessions=n)
    if n == 1:
        why = f"only one fits: {report.describe()}; side requests will evict the conversation"
    elif n < DEFAULT_SESSIONS:
        why = f"default: what memory holds after the weights, {report.describe()}"
    else:
        why = f"default: min({DEFAULT_SESSIONS}, what memory holds after the weights)"
    return kv, why


def _rank_parts(mode: str | None, n_layers: int, split: list[int] | None) -> list:
    """What each rank of ``--distributed mode`` holds (`ds4mlx.engine.rankfit`), for the
    launch's rank count (``launched_world``); ``[None]`` (the whole model) in one process.

    Raises:
        ValueError: a split that does not fit the layers, or an unknown rank count.
    """
    if mode is None:
        return [None]
    from ds4mlx.engine.pipeline import launched_world, split_layers
    from ds4mlx.engine.rankfit import pipeline_parts, tensor_parts

    world = launched_world()
    if world is None:
        raise ValueError("not launched by mlx.launch")
    if mode == "tensor":
        return tensor_parts(n_layers, world)
    return pipeline_parts(split_layers(n_layers, world, split))


def _trace_problem(path: str) -> str | None:
    """Why ``--trace PATH`` cannot be written (a missing folder, a directory, a symlink
    or a file that is not regular), or None:
    said before the model loads, not as a failure to load it."""
    p = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(p):
        return "is a directory; give a file name"
    if os.path.islink(p) or (os.path.exists(p) and not os.path.isfile(p)):
        # The trace holds every prompt and is made private (0600): through a symlink or
        # on a device (/dev/null, a terminal) that would change another file's mode.
        return "is a symlink or not a regular file; give a plain file name"
    parent = os.path.dirname(p)
    if not os.path.isdir(parent):
        return f"no folder {parent} (create it first)"
    if not os.access(parent, os.W_OK) or (os.path.exists(p) and not os.access(p, os.W_OK)):
        return "not writable"
    return None
