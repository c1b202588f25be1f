"""``ds4mlx serve``: flags → `ServerConfig`, load the model, serve until stopped."""

from __future__ import annotations

import logging
import os

from ds4mlx.model.demo import DEMO_MAX_TOKENS, demo_model_dir, ensure_demo_model
from ds4mlx.server.app import serve, start_worker
from ds4mlx.server.config import ServerConfig

NO_MODEL_MESSAGE = """\
ds4mlx serve: no model given.

  Serve a DeepSeek V4 Flash checkpoint directory (config.json + *.safetensors):
      ds4mlx serve -m /path/to/DeepSeek-V4-Flash-4bit      (or set DS4MLX_MODEL)
  MLX conversions such as mlx-community/DeepSeek-V4-Flash-4bit load directly, e.g.
      huggingface-cli download mlx-community/DeepSeek-V4-Flash-4bit --local-dir ~/models/ds4-flash

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
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        return str(e)
    family, kind, proto, _, addr = infos[0]
    try:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        return e.strerror or str(e)
    return None


def run_serve(args, register) -> int:
    """``ds4mlx serve``: load the model (or make the demo one) and serve until stopped.

    ``register(app)`` adds the routes (``ds4mlx.routes.register``; the command line
    chooses them: the server imports no route module)."""
    import sys

    logging.basicConfig(
        level=logging.WARNING if getattr(args, "quiet", False) else logging.INFO,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    model = args.model or os.environ.get("DS4MLX_MODEL")
    if args.demo:
        if model:
            print("ds4mlx serve: give either --model or --demo, not both", file=sys.stderr)
            return 2
        from rich.console import Console

        path = demo_model_dir()
        if not (path / "config.json").is_file():
            Console(stderr=True).print(f"making the tiny demo model in {path} (once)…")
        model = str(ensure_demo_model(path))
    if not model:
        print(NO_MODEL_MESSAGE, file=sys.stderr, end="")
        return 2
    busy = port_problem(args.host, args.port)
    if busy is not None:
        print(
            f"ds4mlx serve: cannot listen on {args.host}:{args.port}: {busy} "
            "(another server there? pick one with --port)",
            file=sys.stderr,
        )
        return 1
    from ds4mlx.server.connections import keep_open_file_limit, raise_open_file_limit

    raise_open_file_limit()  # every client connection holds a descriptor
    with keep_open_file_limit():  # the engine imports mlx-lm, which sets the limit
        from ds4mlx.engine import Engine  # noqa: F401  (imported under the kept limit)
    from ds4mlx.kv.policy import KVCacheSettings

    try:
        kv = KVCacheSettings.from_args(args)
    except ValueError as e:
        print(f"ds4mlx serve: {e}", file=sys.stderr)
        return 2
    kv, sessions_why = _default_sessions(kv, args, model)
    if args.tokens is not None and args.tokens < 1:
        print("ds4mlx serve: --tokens must be >= 1", file=sys.stderr)
        return 2
    cap = (args.tokens or DEMO_MAX_TOKENS) if args.demo else None
    if args.tool_memory_max_ids < 1:
        print("ds4mlx serve: --tool-memory-max-ids must be >= 1", file=sys.stderr)
        return 2
    from ds4mlx.origins import api_keys_from, origin_key

    origins = []
    for o in args.allowed_origin:
        key = origin_key(o)
        if key is None:
            print(
                f"ds4mlx serve: --allowed-origin {o!r} is not an origin (scheme://host[:port])",
                file=sys.stderr,
            )
            return 2
        origins.append(key)
    if args.max_connections is not None and args.max_connections < 1:
        print("ds4mlx serve: --max-connections must be >= 1", file=sys.stderr)
        return 2
    config = ServerConfig(
        model_name=args.served_model_name,
        default_max_tokens=cap if args.demo else args.tokens,
        max_tokens_cap=cap,
        demo_policy=bool(args.demo and args.tokens is None),
        api_keys=api_keys_from(args.api_key, os.environ.get("DS4MLX_API_KEY")),
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
    )
    try:
        engine, worker = start_worker(lambda: _load(model, args, kv.sessions), config)
    except Exception as e:  # LoadError, TokenizerError, OSError, ValueError…
        print(f"ds4mlx serve: cannot load model {model}: {e}", file=sys.stderr)
        return 2
    try:
        return serve(engine, config, worker, register)
    except OSError as e:
        print(f"ds4mlx serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1


def _load(model: str, args, sessions: int):
    """The engine, with ``--speculative`` set (ValueError: a drafter it lacks)."""
    from ds4mlx.engine import Engine
    from ds4mlx.engine.speculative import speculation_for

    engine = Engine.load(model, ctx_size=args.ctx, sessions=sessions)
    engine.speculation = speculation_for(
        engine, getattr(args, "speculative", "off"), getattr(args, "draft_tokens", 4)
    )
    return engine


def _default_sessions(kv, args, model: str):
    """``(settings, why)``: ``kv`` with ``--sessions`` resolved. Given, it is kept (the
    fit check at load refuses more than memory holds, with the numbers); absent, it is
    min(4, what the memory budget holds after the weights), at least 1
    (`ds4mlx.model.fit.sessions_that_fit`)."""
    from dataclasses import replace

    from ds4mlx.model.fit import DEFAULT_SESSIONS, sessions_that_fit

    if args.sessions is not None:
        return kv, "--sessions"
    try:
        n, report = sessions_that_fit(model, args.ctx)
    except Exception:  # FitError, a bad config: the load reports it with its numbers
        return kv, "default"
    kv = replace(kv, sessions=n)
    if n == 1:
        why = f"only one fits: {report.describe()}; side requests will evict the conversation"
    elif n < DEFAULT_SESSIONS:
        why = f"default: what memory holds after the weights, {report.describe()}"
    else:
        why = f"default: min({DEFAULT_SESSIONS}, what memory holds after the weights)"
    return kv, why
