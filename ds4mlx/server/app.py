"""The Quart app, its lifecycle, the startup banner and Hypercorn serving."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from ds4mlx.jobs import GenRequest, Job
from ds4mlx.model.demo import DEMO_NO_THINKING
from ds4mlx.server.config import ServerConfig
from ds4mlx.server.trace import Tracer
from ds4mlx.server.worker import Worker, cache_prompt

# --------------------------------------------------------------------------- state + app


class ServerState:
    """Everything the routes share: engine, worker, config, tool memory.

    ``extensions``: what the registered routes keep for themselves (e.g. their reasoning
    carrier), by name; the server knows no route module.
    """

    def __init__(self, engine, config: ServerConfig, worker: Worker):
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.ctx_size: int = engine.ctx_size
        self.worker = worker
        self.tool_memory = worker.tool_memory
        self.tracer = worker.tracer
        self.scripts = worker.scripts
        self.kv = worker.cache  # ds4mlx.kv.cache.PromptCache (live states, disk tier)
        self.extensions: dict[str, Any] = {}
        self.started = time.time()
        # Model names a request used that the server does not list (logged once each).
        self.unknown_models: set[str] = set()

    def submit(self, request: GenRequest) -> Job:
        return self.worker.submit(request)

    def charged(self, request: GenRequest) -> int:
        """The prompt tokens ``request`` would be charged (its usage) if it ran now: the
        prompt cache's read-only prediction (``PromptCache.peek``: the live state it
        would continue and the suffix it would prefill, else the whole prompt).

        Queues no job and waits for none: any thread, while a job runs (which may
        change the answer once it ends). Tokenizes the suffix, or the prompt.
        """
        return self.kv.peek(cache_prompt(request, self.tokenizer)).prompt_tokens


def start_worker(load: Callable[[], Any], config: ServerConfig) -> tuple[Any, Worker]:
    """Start the inference thread, load the engine on it (``load()``), return both.

    The worker opens the prompt cache (``ds4mlx.kv.cache.PromptCache``) with ``config.kv``.
    Raises whatever ``load`` raises, or ``OSError`` when the disk cache directory cannot
    be created.
    """
    from ds4mlx.dsml import ToolMemory

    memory = ToolMemory(config.tool_memory_max_ids, enabled=config.exact_dsml_replay)
    worker = Worker(tool_memory=memory, tracer=Tracer(config.trace_path), kv_settings=config.kv)
    engine = worker.start(load)
    return engine, worker


def create_app(engine, config: ServerConfig, worker: Worker, register: Callable[[Any], None]):
    """Build the Quart app serving ``engine`` through the running ``worker``.

    ``engine`` and ``worker`` come from `start_worker`; ``register(app)`` adds the
    routes (``ds4mlx.routes.register``: the caller chooses them, the server imports no
    route module). The worker is stopped gracefully in ``after_serving``.
    """
    from quart import Quart

    app = Quart("ds4mlx")
    # Generation can take minutes: no response timeout from Quart itself.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 120
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    state = ServerState(engine, config, worker)
    app.extensions["ds4mlx"] = state
    register(app)

    @app.after_serving
    async def _stop() -> None:
        await asyncio.to_thread(state.worker.stop)

    return app


# --------------------------------------------------------------------------- serving


def banner(engine, config: ServerConfig, url: str, *, connections: int | None = None) -> None:
    """Print the startup banner (model, quant, context, KV bytes, BLAS, URL, who may
    connect, the connection cap) with rich."""
    from rich.console import Console
    from rich.table import Table

    from ds4mlx.blas import blas_label

    try:
        import mlx.core as mx

        device = str(mx.default_device())
    except Exception:  # pragma: no cover
        device = "?"
    kv = _kv_estimate(engine)
    t = Table(show_header=False, box=None, padding=(0, 1))
    t.add_row("[bold]model[/]", f"{config.model_name}  ({engine.path})")
    t.add_row(
        "[bold]model ids[/]",
        ", ".join(
            f"{a} ({'thinking' if config.thinking_default(a) else 'non-thinking'})"
            for a in config.model_ids()
        ),
    )
    t.add_row("[bold]quant[/]", engine.quant_desc)
    t.add_row("[bold]context[/]", f"{engine.ctx_size} tokens")
    if config.max_tokens_cap is not None and config.demo_policy:
        t.add_row(
            "[bold]output[/]",
            f"at most {config.max_tokens_cap} tokens per request (demo cap, reported as a "
            "natural end of turn: the noise model never samples EOS); every model id "
            f"without thinking: {DEMO_NO_THINKING}",
        )
    elif config.max_tokens_cap is not None:
        t.add_row(
            "[bold]output[/]",
            f"at most {config.max_tokens_cap} tokens per request (--tokens: a reply it cuts "
            "ends with max_tokens / length)",
        )
    elif config.default_max_tokens is not None:
        t.add_row("[bold]output[/]", f"{config.default_max_tokens} tokens when a request sets none")
    if kv:
        t.add_row("[bold]KV cache[/]", kv)
    t.add_row("[bold]disk cache[/]", _disk_line(config.kv))
    n = getattr(config.kv, "sessions", 1)
    why = f"; {config.sessions_why}" if config.sessions_why else ""
    t.add_row(
        "[bold]live states[/]",
        f"{n} resident (a conversation, sub-agent or side request each; one job at a time{why})"
        if n > 1
        else f"1 (--sessions N keeps N resident for interleaved conversations{why})",
    )
    t.add_row("[bold]device[/]", f"{device}, BLAS {blas_label()}")
    if (split := engine.distributed) is not None:
        ranks = split["ranks"]
        parts = (
            ", ".join(f"rank {i} layers {r}" for i, r in enumerate(split.get("layers", ())))
            or "every layer split across the ranks"
        )
        t.add_row(
            "[bold]distributed[/]",
            f"{split['mode']} over {ranks} ranks: {parts} (rank 0 serves)",
        )
    t.add_row(
        "[bold]url[/]",
        f"[cyan]{url}[/]  (OpenAI /v1/chat/completions, /v1/completions, /v1/responses; Anthropic /v1/messages)",
    )
    for label, value in access_rows(config):
        t.add_row(label, value)
    if connections is not None:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        t.add_row(
            "[bold]connections[/]",
            f"at most {connections} open (open-file limit {soft}; --max-connections)",
        )
    if config.scripted:
        t.add_row("[bold red]scripted[/]", "POST /debug/script enabled (tests only)")
    if config.trace_path:
        t.add_row("[bold]trace[/]", config.trace_path)
    Console(stderr=True).print(t)


def access_rows(config: ServerConfig) -> list[tuple[str, str]]:
    """The banner's rows on who may use the server: the key, the admitted web origins
    and Host names, and a warning when a non-loopback bind has no key."""
    from ds4mlx.origins import bound_to_loopback

    rows = []
    if config.api_keys:
        n = len(config.api_keys)
        keys = "an API key" if n == 1 else f"one of {n} API keys"
        rows.append(("[bold]auth[/]", f"{keys} required (Authorization: Bearer / x-api-key)"))
    elif not bound_to_loopback(config.host):
        rows.append(
            (
                "[bold red]warning[/]",
                f"listening on {config.host} without --api-key: anyone who can reach this "
                "port can use the model (set --api-key or DS4MLX_API_KEY)",
            )
        )
    if config.cors:
        rows.append(("[bold]web pages[/]", "every origin (--cors)"))
    elif config.allowed_origins:
        rows.append(("[bold]web pages[/]", ", ".join(config.allowed_origins)))
    if config.allowed_hosts:
        rows.append(("[bold]hosts[/]", "loopback, " + ", ".join(config.allowed_hosts)))
    return rows


def _disk_line(kv) -> str:
    """The banner's disk-cache row: directory and budget, or how to turn it on."""
    if kv is None or not kv.enabled:
        return "off (--kv-disk-dir DIR turns it on)"
    return (
        f"{kv.disk_dir}, budget {kv.disk_space_mb} MiB (--kv-disk-space-mb; "
        "--kv-disk-dir none turns it off)"
    )


def _kv_estimate(engine) -> str:
    """KV bytes at a full context, in the compute dtype (bf16 on GPU, float32 on CPU)."""
    n = engine.kv_bytes_at(engine.ctx_size)
    return f"≈{n / 2**20:.1f} MiB at {engine.ctx_size} tokens (window ring + compressed rows)"


def serve(
    engine,
    config: ServerConfig,
    worker: Worker,
    register: Callable[[Any], None],
    *,
    ready: Callable[[str], Any] | None = None,
) -> int:
    """Run the server until SIGINT/SIGTERM; return the exit code.

    ``engine``/``worker`` come from `start_worker`; ``register`` adds the routes (see
    `create_app`).

    Binds ``config.host:config.port``; the URL is printed in the banner and passed to
    ``ready`` once the sockets listen.
    """
    from hypercorn.asyncio import serve as hyper_serve
    from hypercorn.config import Config as HyperConfig
    from hypercorn.config import Sockets

    from ds4mlx.server.connections import ConnectionGate, default_cap, quiet_accept_errors

    app = create_app(engine, config, worker, register)
    gate = ConnectionGate(config.max_connections or default_cap())
    app.asgi_app = gate.asgi(app.asgi_app)

    class GatedConfig(HyperConfig):
        # Hypercorn binds the sockets; their accepts then go through the gate.
        def create_sockets(self) -> Sockets:
            made = super().create_sockets()
            return Sockets(
                made.secure_sockets,
                [gate.listener(s) for s in made.insecure_sockets],
                made.quic_sockets,
            )

    hc = GatedConfig()
    hc.bind = [f"{_host_for_bind(config.host)}:{config.port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = 5.0
    hc.keep_alive_timeout = 75.0
    hc.h11_max_incomplete_size = 64 * 1024
    hc.websocket_max_message_size = config.max_body_bytes

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(quiet_accept_errors)
        # SIGHUP too: a closed terminal or a dropped ssh session stops the server as
        # Ctrl+C does (shutdown saves, streams ended), not at once.
        log = logging.getLogger("ds4mlx.server")

        def stopping(sig: signal.Signals) -> None:
            if not stop.is_set():  # the log says a clean stop began (and ended, below)
                log.info("%s: stopping (the running job ends, states are saved)", sig.name)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                loop.add_signal_handler(sig, stopping, sig)
            except (NotImplementedError, RuntimeError):  # pragma: no cover - Windows
                pass

        @app.before_serving
        async def _announce() -> None:
            url = _bound_url(hc, config)
            banner(engine, config, url, connections=gate.cap)
            if ready:
                ready(url)

        async def shutdown_trigger() -> None:
            await stop.wait()
            # Stop generating first: the running job is cancelled and queued ones fail,
            # so their streams end with final events now and Hypercorn's graceful close
            # has nothing left to wait for.
            await asyncio.to_thread(worker.stop)

        await hyper_serve(app, hc, shutdown_trigger=shutdown_trigger)
        log.info("stopped")

    asyncio.run(main())
    return worker.exit_code


def _host_for_bind(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _bound_url(hc, config: ServerConfig) -> str:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    return f"http://{_host_for_bind(host)}:{config.port}"
