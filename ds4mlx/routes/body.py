"""Request bodies: read on the event loop, parsed and validated off it.

The loop only receives the bytes (`read_body`; Quart enforces the 32 MiB limit while
they arrive); JSON parsing, validation and everything a route builds from the body run
on a small thread pool (`offload`), so one large body never stalls the other clients
(``/health`` included).

A thread alone is not enough: the JSON parser and pydantic's validator are single C
calls that hold the GIL for their whole run (200k messages: ~1.3 s of validation on one
call). `validate` therefore validates a long list field (``messages``, ``input``,
``tools``) in slices of `SLICE` items, one short call each, and the thread yields the
GIL between them.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import typing
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from quart import current_app, request
from werkzeug.exceptions import HTTPException

from ds4mlx.routes.errors import APIError, errors_to_api, http_exception_to_api

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

# Items of a list field validated per call (a few milliseconds each): the GIL changes
# hands between calls, so the event loop runs while a long list is validated.
SLICE = 2000
# Threads parsing and building requests: bounded, so a burst of large bodies queues
# here instead of multiplying memory and GIL contention.
_WORKERS = 2
_pool: ThreadPoolExecutor | None = None


class OpenModel(BaseModel):
    """Base of every wire schema: unknown fields are kept, not rejected.

    Clients send beta and vendor fields (docs/ARCHITECTURE.md §6); only what a route reads is
    declared and validated.
    """

    model_config = ConfigDict(extra="allow")


async def offload(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` on the body pool (at most `_WORKERS` at a time), in a
    copy of the caller's context (so ``quart.current_app`` works there); its exception
    propagates."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="ds4mlx-body")
    ctx = contextvars.copy_context()
    call = functools.partial(ctx.run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_pool, call)


async def read_body() -> bytes:
    """The request body's bytes, its ``Content-Encoding`` undone (`decode_body`, off the
    loop); on the event loop only the transfer.

    Raises:
        APIError: 413 over the body limit (the bytes sent, and the decoded bytes); 415
            for a content coding this server does not decode; 400 for a body that does
            not decode.
    """
    codings = content_codings(request.headers.get("Content-Encoding", ""))
    try:
        raw = await request.get_data(cache=False, as_text=False)
    except HTTPException as e:
        raise http_exception_to_api(e) from None
    if not codings:
        return raw
    limit = current_app.config.get("MAX_CONTENT_LENGTH") or DECODED_LIMIT
    return await offload(decode_body, raw, codings, limit)


# Content codings a body may arrive in: gzip and deflate always (stdlib zlib), zstd when
# the optional ``zstandard`` package is installed.
DECODED_LIMIT = 32 * 1024 * 1024


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard


def content_codings(header: str) -> list[str]:
    """The codings of a ``Content-Encoding`` header, in the order they were applied
    (``identity`` left out), checked before the body is read.

    Raises:
        APIError: 415 naming a coding this server does not decode.
    """
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    codings = [c for c in codings if c != "identity"]
    known = {"gzip", "x-gzip", "deflate"} | ({"zstd"} if _zstd() is not None else set())
    for c in codings:
        if c not in known:
            raise APIError(
                415,
                f"Content-Encoding {c!r} is not supported; send the body uncompressed"
                f" or as {', '.join(sorted(known - {'x-gzip'}))}",
                type="invalid_request_error",
                code="unsupported_content_encoding",
            )
    return codings


def decode_body(raw: bytes, codings: list[str], limit: int) -> bytes:
    """Undo ``codings`` (applied in that order) on ``raw``, never producing more than
    ``limit`` bytes: a small compressed body that expands past the body limit (a zip
    bomb) is refused as soon as it does, without expanding the rest.

    Raises:
        APIError: 413 when the decoded body exceeds ``limit`` bytes; 400 for data that
            is not valid in its coding.
    """
    import zlib

    for coding in reversed(codings):
        try:
            if coding == "zstd":
                raw = _unzstd(raw, limit)
            else:
                wbits = 16 + zlib.MAX_WBITS if coding in ("gzip", "x-gzip") else zlib.MAX_WBITS
                raw = _inflate(raw, wbits, limit, raw_fallback=coding == "deflate")
        except APIError:
            raise
        except Exception as e:  # zlib.error, zstandard.ZstdError: the bytes, not us
            raise APIError(400, f"request body is not valid {coding} data: {e}") from None
    return raw


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"decoded request body too large (limit {limit} bytes)", code="request_too_large"
    )


def _inflate(raw: bytes, wbits: int, limit: int, *, raw_fallback: bool) -> bytes:
    """zlib/gzip data → bytes, at most ``limit`` (413 past it). ``raw_fallback``: HTTP
    ``deflate`` is zlib-wrapped, but some clients send a bare deflate stream."""
    import zlib

    try:
        d = zlib.decompressobj(wbits)
        out = d.decompress(raw, limit + 1)
    except zlib.error:
        if not raw_fallback:
            raise
        d = zlib.decompressobj(-zlib.MAX_WBITS)
        out = d.decompress(raw, limit + 1)
    if len(out) > limit or d.unconsumed_tail:
        raise _too_large(limit)
    if not d.eof:
        raise APIError(400, "request body is a truncated compressed stream")
    return out


def _unzstd(raw: bytes, limit: int) -> bytes:
    """zstd data → bytes, at most ``limit`` (413 past it)."""
    import io

    reader = _zstd().ZstdDecompressor().stream_reader(io.BytesIO(raw))
    out = bytearray()
    while len(out) <= limit:  # read() may return less than asked before the end
        piece = reader.read(min(1 << 20, limit + 1 - len(out)))
        if not piece:
            return bytes(out)
        out += piece
    raise _too_large(limit)


def parse_json(raw: bytes | str) -> Any:
    """``raw`` as JSON (call off the loop).

    Raises:
        APIError: 400 invalid UTF-8, empty, malformed or too deeply nested JSON.
    """
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    if not raw.strip():
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        return json.loads(raw)
    except RecursionError:
        raise APIError(400, "request JSON is nested too deeply") from None
    except ValueError as e:
        raise APIError(400, f"malformed JSON: {e}") from None


def parse(model: type[M], raw: bytes | str) -> M:
    """Parse and validate a body with ``model`` (call off the loop; `APIError` 4xx)."""
    return validate(model, parse_json(raw))


async def read_json() -> Any:
    """The body as JSON, parsed off the loop (`parse_json`)."""
    return await offload(parse_json, await read_body())


async def parse_body(model: type[M]) -> M:
    """Read the body and validate it with ``model`` off the loop; return the typed request.

    Unknown fields are tolerated (the models allow extras: clients send beta fields).

    Raises:
        APIError: 4xx for any malformed, mistyped or oversized body.
    """
    return await offload(parse, model, await read_body())


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(v), "number" if isinstance(v, int | float) else type(v).__name__
    )


def _encode_sliced(data: Any) -> None:
    """UTF-8-encode ``data`` as JSON, a top-level list `SLICE` items per call (each C
    call holds the GIL); raises `UnicodeEncodeError` for a lone surrogate."""
    for v in data.values() if isinstance(data, dict) else [data]:
        if isinstance(v, list) and len(v) > SLICE:
            for start in range(0, len(v), SLICE):
                json.dumps(v[start : start + SLICE], ensure_ascii=False).encode("utf-8")
        else:
            json.dumps(v, ensure_ascii=False).encode("utf-8")
    if isinstance(data, dict):
        json.dumps(list(data), ensure_ascii=False).encode("utf-8")


def _lone_surrogate_path(data: Any) -> str | None:
    """Path (``messages.0.content``) of the first string holding a lone UTF-16 surrogate.

    JSON allows ``"\\ud800"`` escapes that decode to no Unicode character; the tokenizer
    (and UTF-8 output) cannot take them. Fast path: C-level encodes of the body
    (`_encode_sliced`); the walk only runs when they fail.
    """
    try:
        _encode_sliced(data)
        return None
    except UnicodeEncodeError:
        pass
    except (RecursionError, ValueError, TypeError):
        return None
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        v, path = stack.pop()
        items: Any = ()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(v, dict):
            items = reversed(list(v.items()))
        elif isinstance(v, list):
            items = reversed(list(enumerate(v)))
        for k, sub in items:
            if isinstance(k, str):
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "(key)"
            stack.append((sub, f"{path}.{k}" if path else str(k)))
    return None


def _list_item(annotation: Any) -> Any:
    """The item type of a field annotated ``list[X]`` (possibly in a union with None or
    ``str``), else None."""
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0]
    for arm in typing.get_args(annotation):
        if typing.get_origin(arm) is list:
            return typing.get_args(arm)[0]
    return None


@functools.cache
def _slice_adapter(item: Any) -> TypeAdapter:
    return TypeAdapter(list[item])


def _long_lists(model: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``data`` holding a list longer than `SLICE` that ``model`` declares
    as a list of one item type: field name → item type."""
    out = {}
    for name, f in model.model_fields.items():
        key = f.alias or name
        v = data.get(key)
        if isinstance(v, list) and len(v) > SLICE:
            item = _list_item(f.annotation)
            if item is not None:
                out[key] = (name, item)
    return out


def _validate_sliced(model: type[M], data: dict[str, Any], long: dict[str, Any]) -> M:
    """``model.model_validate(data)`` with each long list validated in slices (the same
    result and the same errors as one call, without holding the GIL throughout)."""
    errs: list[dict[str, Any]] = []
    obj = None
    # The model without the long lists' tails: their first item keeps a length
    # constraint (``min_length=1``) satisfied; the slices then validate every item.
    try:
        obj = model.model_validate({**data, **{k: data[k][:1] for k in long}})
    except ValidationError as e:
        errs += [
            err
            for err in e.errors(include_url=False)
            if err.get("loc", ())[:1] not in [(k,) for k in long]
        ]
    done: dict[str, list[Any]] = {}
    for key, (name, item) in long.items():
        adapter, items, out = _slice_adapter(item), data[key], []
        for start in range(0, len(items), SLICE):
            try:
                out += adapter.validate_python(items[start : start + SLICE])
            except ValidationError as e:
                for err in e.errors(include_url=False):
                    loc = err.get("loc", ())
                    errs.append({**err, "loc": (key, start + int(loc[0]), *loc[1:])})
        done[name] = out
    if errs or obj is None:
        raise errors_to_api(errs, data)
    for name, value in done.items():
        setattr(obj, name, value)
    return obj


def validate(model: type[M], data: Any) -> M:
    """Validate ``data`` with ``model``; 400 `APIError` with the field path on failure.

    Also rejects a body that is not an object and strings holding a lone UTF-16
    surrogate (``"\\ud800"``), naming the field. Long lists are validated in slices
    (see the module doc).
    """
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {_json_type(data)}")
    bad = _lone_surrogate_path(data)
    if bad is not None:
        raise APIError(
            400,
            f"{bad}: string contains a lone UTF-16 surrogate escape (\\uD800-\\uDFFF "
            "without its pair), which is not a Unicode character",
            param=bad,
        )
    try:
        long = _long_lists(model, data)
        if long:
            return _validate_sliced(model, data, long)
        return model.model_validate(data)
    except ValidationError as e:
        raise errors_to_api(list(e.errors(include_url=False)), data) from None
    except RecursionError:
        raise APIError(400, "request JSON is nested too deeply") from None
