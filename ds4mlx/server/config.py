"""Settings of one ``ds4mlx serve`` process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL_NAME = "deepseek-v4-flash"
# Alias → thinking default. "deepseek-chat" is DeepSeek's own name for non-thinking mode.
DEFAULT_ALIASES = {"deepseek-chat": False, "deepseek-reasoner": True}


# --------------------------------------------------------------------------- config


@dataclass
class ServerConfig:
    """Settings of one server (CLI flags of ``ds4mlx serve``).

    Attributes:
        model_name: the served model id (``--served-model-name``).
        aliases: extra model ids → thinking default (``deepseek-chat`` = non-thinking).
        default_max_tokens: output tokens when a request sets none (``--tokens``);
            None means "until the context is full".
        max_tokens_cap: every request's output limit is capped to this (``--demo``:
            ``--tokens`` or ``ds4mlx.model.demo.DEMO_MAX_TOKENS``), or None. The demo model is noise and
            never samples EOS; clients that ask for 32000 tokens would wait minutes.
        demo_policy: ``--demo`` without ``--tokens``: the cap stands in for the noise
            model's EOS (a turn it cuts is a natural end) and every request runs without
            thinking, so a client always gets visible text (the noise model would spend
            the whole cap reasoning). With an explicit ``--tokens`` the demo behaves as a
            real model with that output limit: thinking as asked, and a turn the limit
            cuts ends with ``max_tokens`` / ``length`` (how clients' retries reproduce).
        api_keys: accepted bearer / ``x-api-key`` values (``--api-key``, repeatable, or
            ``DS4MLX_API_KEY`` comma-separated); empty: no key required.
        cors: admit every ``Origin``, answer CORS preflights and add
            ``Access-Control-Allow-Origin: *`` (``--cors``).
        allowed_origins: origins (``scheme://host[:port]``) admitted besides loopback
            ones, with CORS answers naming them (``--allowed-origin``, repeatable).
        allowed_hosts: ``Host`` names answered besides ``localhost``, ``127.0.0.1`` and
            ``[::1]`` when bound to loopback (``--allowed-host``, repeatable).
            ``ds4mlx.routes.access`` has the rules.
        max_connections: open client connections at most (``--max-connections``);
            None: the open-file limit less a reserve
            (``ds4mlx.server.connections.default_cap``).
        trace_path: JSON-lines trace file (``--trace``), or None.
        scripted: enable ``POST /debug/script`` (``--enable-scripted-decoding``; tests).
        keep_billing_header: keep Claude Code's ``x-anthropic-billing-header`` system
            line (docs/ARCHITECTURE.md §3).
        keepalive_s: seconds between SSE keepalives while a stream has nothing to send.
        max_body_bytes: larger request bodies get 413.
        host, port: where Hypercorn binds.
        reasoning_key: secret of the reasoning carrier (AES-SIV) (Responses ``encrypted_content``,
            Anthropic thinking ``signature``); None derives one (see
            ``ds4mlx.routes.common.load_reasoning_key``).
        kv: ``ds4mlx.kv.policy.KVCacheSettings`` (``--kv-disk-dir``, ``--kv-cache-*``);
            None: no disk cache.
        sessions_why: how ``kv.sessions`` was chosen, for the banner (``--sessions``, or
            the default's memory figures).
        tool_memory_max_ids: tool-call ids whose exact DSML is remembered
            (``--tool-memory-max-ids``).
        exact_dsml_replay: render replayed tool calls from the exact sampled DSML
            (off with ``--disable-exact-dsml-tool-replay``).
        tool_call_dispatch: every streamed chat completion sends ``event:
            tool_call_dispatch`` at each call's close (``--enable-streaming-tool-dispatch``;
            a request's ``tool_call_dispatch`` field does it for that request).
        grammar_compile_ms: the clock bound on compiling a request's structured-output
            or tool grammar (``--grammar-compile-ms``), waiting for a compile thread included;
            past it, a 400 (a 429 if no compile thread came free).
    """

    model_name: str = DEFAULT_MODEL_NAME
    aliases: dict[str, bool] = field(default_factory=lambda: dict(DEFAULT_ALIASES))
    default_max_tokens: int | None = None
    max_tokens_cap: int | None = None
    demo_policy: bool = False
    api_keys: tuple[str, ...] = ()
    cors: bool = False
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    max_connections: int | None = None
    trace_path: str | None = None
    scripted: bool = False
    keep_billing_header: bool = False
    keepalive_s: float = 10.0
    max_body_bytes: int = 32 * 1024 * 1024
    host: str = "127.0.0.1"
    port: int = 8000
    reasoning_key: bytes | None = None
    kv: Any = None
    sessions_why: str = ""
    tool_memory_max_ids: int = 100_000
    exact_dsml_replay: bool = True
    tool_call_dispatch: bool = False
    grammar_compile_ms: int = 5000

    def model_ids(self) -> list[str]:
        """Every model id the server answers to, the served name first."""
        return [self.model_name, *[a for a in self.aliases if a != self.model_name]]

    def thinking_default(self, model: str | None) -> bool:
        """Thinking mode for a request naming ``model`` (unknown names: thinking on;
        never under the demo policy, which serves every request without thinking)."""
        if self.demo_policy:
            return False
        if model and model in self.aliases and model != self.model_name:
            return self.aliases[model]
        return True
