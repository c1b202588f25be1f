"""Request bodies: read on the event loop, parsed and validated off it.

The loop only receives the bytes (`read_body`; Quart enforces the 32 MiB limit while
they arrive); JSON parsing, validation and everything a route builds from the body run
off the loop (`offload`), so one large body never stalls the other clients (``/health``
included).

Where that work runs:

- A body of at most `VET_BYTES` (nearly every request) is built on a small thread pool.
  A thread alone does not free the loop for long: the JSON parser, pydantic's validator,
  a regex or a join over the whole text are single C calls holding the GIL, and so is
  every full collection of the cyclic garbage collector, which a body of many small
  objects triggers again and again as the heap grows (200k messages: ~15 collections of
  0.3-0.5 s CPU each, 1-2.5 s of wall time on a loaded machine). So `validate` takes a
  long list in slices of `SLICE` items, and bodies that could hold such calls for long
  do not come here first:
- A larger body is first *vetted* in a child process (one, started lazily, `spawn`ed so
  no thread state is forked, gone after `VET_IDLE_S` seconds without a large body, 30 or
  ``$DS4MLX_VET_IDLE_S``): the
  child runs the same function on the same bytes, with a snapshot of the state a body
  needs (the context size, the configuration, the reasoning carrier's key; no tool
  memory, no tokenizer). If the function raises `APIError` there (malformed, invalid,
  over the cheap context bound), that is the answer: the parent never parses the body. Otherwise (the body is accepted, or the function needs what the
  child lacks) the child's result is dropped and the parent builds the request on the
  thread pool as above. The child only ever shortcuts a refusal; what the server accepts
  is always built by the one in-process path, with the live tool memory.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import multiprocessing
import signal
import typing
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from quart import current_app, request
from werkzeug.exceptions import HTTPException

from ds4mlx.argtypes import env_positive
from ds4mlx.routes import carrier
from ds4mlx.routes.common import state
from ds4mlx.routes.errors import APIError, errors_to_api, http_exception_to_api

log = logging.getLogger("ds4mlx.server")

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

# Items of a list field validated per call (a few milliseconds each): the GIL changes
# hands between calls, so the event loop runs while a long list is validated.
SLICE = 2000
# Threads parsing and building requests: bounded, so a burst of large bodies queues
# here instead of multiplying memory and GIL contention.
_WORKERS = 2
_pool: ThreadPoolExecutor | None = None
# Work a body function hands back to `offload` (`defer`): ``(step, cancel)`` pairs,
# ``step()`` awaited on the event loop once the function returns (a grammar compile, so
# no parsing thread waits on one), ``cancel()`` run if the function raises instead.
_deferred: ContextVar[list[tuple[Callable[[], Awaitable[None]], Callable[[], Any]]] | None] = (
    ContextVar("ds4mlx_deferred", default=None)
)
# Bodies larger than this (bytes) are vetted in the child process first. Below it the
# in-process work holds the GIL for tens of milliseconds at most (a 1 MiB body: ~30 ms
# of parsing), and the hop (spawn once, then a pickle of the bytes each way) is not paid.
VET_BYTES = 1 << 20
# One child: a burst of large bodies queues for it, so their memory is one body's.
_vet_pool: ProcessPoolExecutor | None = None
# The child exits after this many seconds without a large body: it holds the route
# modules' imports (~300 MB) and what the allocator kept of its largest body.
# ``$DS4MLX_VET_IDLE_S`` sets it (the tests that watch the child exit shorten it).
VET_IDLE_S = env_positive("DS4MLX_VET_IDLE_S", 30.0)
# [bodies being vetted now, loop time the last one ended]
_vetting: list[float] = [0, 0.0]


class OpenModel(BaseModel):
    """Base of every wire schema: unknown fields are kept, not rejected.

    Clients send beta and vendor fields (docs/ARCHITECTURE.md §6); only what a route reads is
    declared and validated, and strictly, as the hosted APIs do: a JSON type is never
    coerced into another (``"stream": "yes"``, ``"max_tokens": true`` and ``"n": 1.5`` are
    400s, not a stream, one token and one choice; an integer is still a valid float), and
    ``NaN``/``Infinity`` (which Python's JSON parser accepts) are no number.
    """

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    # Undeclared fields that carry a wish the route cannot carry out, or that are another
    # protocol's and would be dropped unread: field -> why (`validate` refuses them set).
    refused: ClassVar[dict[str, str]] = {}


class ContentPart(OpenModel):
    """A content part of any protocol (chat's message parts, Responses' input and tool
    output parts and reasoning text, Anthropic's tool result blocks): its ``type`` and,
    when it has one, its ``text``, checked (a list where ``type`` goes, a number for
    ``text``, are 400s naming the part); every other field kept as sent (an image's or a
    document's ``source``, which its placeholder names)."""

    type: str
    text: str | None = None


async def offload(fn: Callable[..., T], raw: bytes | str, *args: Any) -> T:
    """``fn(raw, *args)`` off the event loop: the request ``fn`` builds from the body
    ``raw``; its exception propagates.

    Work ``fn`` hands back with `defer` (a grammar compile) is awaited here, after
    ``fn`` returns: the pool's threads never wait on it.

    A body over `VET_BYTES` is first vetted in the child process (module doc): an
    `APIError` ``fn`` raises there is raised here without running ``fn`` in this
    process. Then (and for every smaller body) ``fn`` runs on the thread pool (at most
    `_WORKERS` at a time), in a copy of the caller's context (so ``quart.current_app``
    works there). ``fn`` and ``args`` must pickle for the vetting (module-level
    functions, plain data); one that does not is simply not vetted.
    """
    global _pool
    if len(raw) > VET_BYTES:
        refusal = await _vet(fn, raw, args)
        if refusal is not None:
            raise refusal
    if _pool is None:
        _pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="ds4mlx-body")
    ctx = contextvars.copy_context()
    steps: list[tuple[Callable[[], Awaitable[None]], Callable[[], Any]]] = []
    ctx.run(_deferred.set, steps)
    call = functools.partial(ctx.run, fn, raw, *args)
    try:
        result = await asyncio.get_running_loop().run_in_executor(_pool, call)
    except BaseException:
        for _, cancel in steps:
            cancel()
        raise
    for i, (step, _) in enumerate(steps):
        try:
            await step()
        except BaseException:
            for _, cancel in steps[i + 1 :]:
                cancel()
            raise
    return result


def defer(step: Callable[[], Awaitable[None]], cancel: Callable[[], Any]) -> bool:
    """Have `offload` await ``step()`` on the event loop once the body function that
    calls this returns (before its result is used; an `APIError` it raises is the
    request's), or run ``cancel()`` if that function raises instead.

    Returns False outside `offload` (the body-vetting child, a direct call): the caller
    then does the work itself.
    """
    steps = _deferred.get()
    if steps is None:
        return False
    steps.append((step, cancel))
    return True


@dataclass
class ChildState:
    """What a body function reads from the server state (``routes.common.state``), in
    the vetting child: the context size (tokens) and the `ServerConfig`. No tool memory
    (a remembered call renders canonically there), no tokenizer (a function that
    tokenizes fails there: no verdict, the parent runs it)."""

    ctx_size: int
    config: Any
    tool_memory: None = None
    tokenizer: None = None
    unknown_models: set[str] = field(default_factory=set)


async def _vet(fn: Callable[..., Any], raw: bytes | str, args: tuple) -> APIError | None:
    """The child's refusal of ``fn(raw, *args)``, or None (accepted, or no verdict)."""
    global _vet_pool
    if _vet_pool is None:
        st = state()
        snapshot = ChildState(ctx_size=st.ctx_size, config=st.config)
        _vet_pool = ProcessPoolExecutor(
            1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_child_start,
            initargs=(snapshot, carrier.carrier().key),
        )
    pool = _vet_pool
    _vetting[0] += 1
    try:
        return await asyncio.wrap_future(pool.submit(_child_vet, fn, raw, args))
    except BrokenProcessPool:
        log.warning("the body-vetting child died; building this body in process")
        if _vet_pool is pool:
            shutdown()  # the next large body starts a new child
    except Exception as e:  # e.g. an unpicklable call: the parent decides
        log.warning("body not vetted (%s: %s); building it in process", type(e).__name__, e)
    finally:
        _vetting[0] -= 1
        loop = asyncio.get_running_loop()
        _vetting[1] = loop.time()
        loop.call_later(VET_IDLE_S, _retire_idle)
    return None


def _retire_idle() -> None:
    """Stop the child once no large body came for `VET_IDLE_S` (on the event loop)."""
    idle = asyncio.get_running_loop().time() - _vetting[1]
    if _vetting[0] == 0 and idle >= VET_IDLE_S * 0.99:
        shutdown()


def shutdown() -> None:
    """Stop the vetting child, if one was started (the server's ``after_serving``)."""
    global _vet_pool
    if _vet_pool is not None:
        _vet_pool.shutdown(wait=False, cancel_futures=True)
        _vet_pool = None


# The vetting child's app: its extensions are the `ChildState` and the carrier.
_child_app: Any = None


def _child_start(snapshot: ChildState, carrier_key: bytes) -> None:
    from quart import Quart

    global _child_app
    # The parent owns Ctrl-C: the terminal's SIGINT reaches the whole process group, and
    # the parent's shutdown stops this child.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _child_app = Quart("ds4mlx-vet")
    _child_app.extensions["ds4mlx"] = snapshot
    carrier.install(_child_app, carrier_key)


def _child_vet(fn: Callable[..., Any], raw: bytes | str, args: tuple) -> APIError | None:
    """In the child: run ``fn(raw, *args)`` in the child's app context; its `APIError`,
    else None. The result is dropped (never pickled back): only a refusal is an answer."""

    async def run() -> None:
        async with _child_app.app_context():
            fn(raw, *args)

    try:
        asyncio.run(run())
    except APIError as e:
        return e
    except Exception:
        return None  # needs what the child lacks, or a fault: the parent finds out
    return None


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
    except json.JSONDecodeError as e:
        raise APIError(400, f"malformed JSON: {e}") from None
    except ValueError:
        # Python's limit on integer digits (4300): its message advises a Python call.
        raise APIError(400, "request JSON holds an integer of more than 4300 digits") from None


def parse(model: type[M], raw: bytes | str) -> M:
    """Parse and validate a body with ``model`` (call off the loop; `APIError` 4xx)."""
    return validate(model, parse_json(raw))


async def parse_body(model: type[M]) -> M:
    """Read the body and validate it with ``model`` off the loop; return the typed request.

    Unknown fields are tolerated (the models allow extras: clients send beta fields).

    Raises:
        APIError: 4xx for any malformed, mistyped or oversized body.
    """
    return await offload(_parse_as, await read_body(), model)


def _parse_as(raw: bytes | str, model: type[M]) -> M:
    return parse(model, raw)


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
    ``str``), else None: also for a union of several list types (a completion's
    ``prompt``: ``list[str] | list[int] | …``), where no one item type can validate the
    slices the way the whole union validates the list."""
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0]
    arms = [a for a in typing.get_args(annotation) if typing.get_origin(a) is list]
    return typing.get_args(arms[0])[0] if len(arms) == 1 else None


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
        req = _validate_sliced(model, data, long) if long else model.model_validate(data)
    except ValidationError as e:
        raise errors_to_api(list(e.errors(include_url=False)), data) from None
    except RecursionError:
        raise APIError(400, "request JSON is nested too deeply") from None
    _refuse_unread(req)
    return req


def _refuse_unread(req: BaseModel) -> None:
    """A 400 naming the first field of ``type(req).refused`` the request sets: an
    explicit wish is refused rather than dropped (docs/ARCHITECTURE.md §6). Unset is
    absent, null, false or an empty list; ``["text"]`` asks for nothing more than text."""
    extra = req.model_extra or {}
    for name, why in getattr(type(req), "refused", {}).items():
        v = extra.get(name)
        if v is None or v is False or v == [] or v == ["text"]:
            continue
        raise APIError(400, f"{name}: {why}", param=name)
