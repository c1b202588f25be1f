"""Address and header rules of who may use the server, as plain functions (stdlib only):
host names, loopback binds and origins, the JSON media type, API keys from flags.

Both the routes' access checks (`ds4mlx.routes.access`, the threat model) and the server's
flag parsing and banner (`ds4mlx.server`) use them, so they sit below both.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _loopback_host(host: str) -> bool:
    """Whether a bare host (no port, no brackets) names this machine's loopback:
    ``localhost`` or a loopback IP literal (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The host of a ``Host`` header value, lower-cased, without port or IPv6 brackets.

    ``"LocalHost:8000"`` → ``"localhost"``, ``"[::1]:8000"`` → ``"::1"``. A value that is
    not ``host[:port]`` comes back whole (lower-cased) and matches no allowed name.
    """
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        if end > 0 and (end == len(v) - 1 or (v[end + 1] == ":" and v[end + 2 :].isdigit())):
            return v[1:end]
        return v
    name, sep, port = v.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        return name
    return v


def bound_to_loopback(bind_host: str) -> bool:
    """Whether ``--host`` is a loopback address (the Host check applies only then)."""
    return _loopback_host(host_name(bind_host))


def origin_key(value: str) -> str | None:
    """An origin (``scheme://host[:port]``) in the form browsers send it: lower-case,
    default port left out, no path. None when ``value`` is not one (``null`` included).

    Raises nothing; ``--allowed-origin`` values go through it too, so ``HTTP://App:443``
    given as ``https://app`` matches what the browser sends.
    """
    v = value.strip()
    if not v or v.lower() == "null":
        return None
    try:
        parts = urlsplit(v)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if not scheme or not host or parts.path not in ("", "/") or parts.query or parts.username:
        return None
    shown = f"[{host}]" if ":" in host else host
    if port is not None and port != _DEFAULT_PORTS.get(scheme):
        shown += f":{port}"
    return f"{scheme}://{shown}"


def loopback_origin(value: str) -> bool:
    """Whether ``value`` is an http(s) origin on a loopback host (any port)."""
    key = origin_key(value)
    if key is None:
        return False
    parts = urlsplit(key)
    return parts.scheme in ("http", "https") and _loopback_host(parts.hostname or "")


def json_content_type(value: str | None) -> bool:
    """``application/json`` or any ``*/*+json`` media type (parameters allowed)."""
    if not value:
        return False
    media = value.split(";", 1)[0].strip().lower()
    kind, sep, sub = media.partition("/")
    return bool(sep and kind and " " not in media) and (
        media == "application/json" or sub.endswith("+json")
    )


def api_keys_from(flags: Iterable[str] | None, env: str | None) -> tuple[str, ...]:
    """The accepted API keys: every ``--api-key`` given, else ``DS4MLX_API_KEY`` split at
    commas. Empty: no key required (neither given).

    Raises:
        ValueError: a key given that is empty or blank (``--api-key "$KEY"`` or
            ``DS4MLX_API_KEY=$KEY`` with ``KEY`` unset must not turn authentication off),
            or one with a character outside printable ASCII (HTTP sends header values as
            bytes: a client's UTF-8 ``é`` would never equal the key).
    """
    if flags:
        given, where = list(flags), "--api-key"
    elif env is not None and env.strip().strip(","):
        given, where = env.strip().strip(",").split(","), "DS4MLX_API_KEY"
    elif env is not None:
        raise ValueError(
            "DS4MLX_API_KEY is set but holds no key (refused: it would turn authentication "
            "off; unset it to serve without a key)"
        )
    else:
        return ()
    if any(not k.strip() for k in given):
        raise ValueError(f"{where}: an empty key (refused: it would turn authentication off)")
    keys = tuple(dict.fromkeys(k.strip() for k in given))
    if any(not (k.isascii() and k.isprintable()) for k in keys):
        raise ValueError(f"{where}: a key may hold printable ASCII characters only")
    return keys
