"""Engine (model + tokenizer) and the live Session (tokens, KV cache, next-token logits).

DESIGN.md §1/§3: one mmapped model, one live ``Session``; every request is a job that
runs on it, one at a time, on one thread. A ``Session`` is not thread-safe: all of its
methods (and anything touching its MLX arrays) must run on the inference thread.

Typical use::

    engine = Engine.load("/models/ds4-flash")
    s = engine.session
    s.prefill(engine.tokenizer.encode(prompt), progress=print)
    for tok in s.generate([], SamplingParams(temperature=0), max_tokens=64,
                          stop_ids={engine.tokenizer.eos_id}):
        ...
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ds4mlx.tokenizer import Tokenizer

# Prefill chunk (tokens per forward). Large enough to keep GEMMs efficient, small enough
# that the per-chunk activations stay modest and cancellation/progress stay responsive.
DEFAULT_CHUNK = 512

# Default context when the caller does not choose one: the model's own limit (1M for
# DS4 Flash) is far more than a single machine wants to promise by default. The KV cache
# grows with the context (compressed rows), so the CPU backend gets the smaller figure.
DEFAULT_CTX_GPU = 65536
DEFAULT_CTX_CPU = 32768

SNAPSHOT_FORMAT = "ds4mlx-session"
SNAPSHOT_VERSION = "1"
_TOKENS_KEY = "tokens"
_LOGITS_KEY = "logits"


class ContextOverflowError(ValueError):
    """Feeding tokens would exceed the session's context size.

    Attributes:
        have: tokens already in the session.
        adding: tokens the caller tried to add.
        ctx_size: the limit.
    """

    def __init__(self, have: int, adding: int, ctx_size: int):
        self.have, self.adding, self.ctx_size = have, adding, ctx_size
        super().__init__(
            f"context overflow: {have} tokens in the session + {adding} new = "
            f"{have + adding} > context size {ctx_size}"
        )


class SnapshotError(ValueError):
    """A session snapshot is malformed or belongs to another model / cache layout."""


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token from the logits.

    Args:
        temperature: softmax temperature (>= 0); 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        min_p: drop tokens whose probability is below ``min_p`` × the top probability;
            0 disables it.
        seed: seeds the session's generator at the start of a request
            (``Session.seed``), making the sampled continuation reproducible.

    The filters are mlx-lm's (``apply_top_p``, ``apply_min_p``, ``apply_top_k``, in the
    order mlx-lm's ``make_sampler`` applies them, on the untempered distribution); the
    temperature then scales the surviving log-probabilities before the categorical draw.

    Raises:
        ValueError: a value is out of range.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1


def _sample_token(logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
    """Draw one token id (uint32 scalar array) from float32 ``logits`` of shape (vocab,)."""
    logprobs = (logits - mx.logsumexp(logits, keepdims=True))[None]
    vocab = logprobs.shape[-1]
    if 0 < params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < vocab:
        logprobs = apply_top_k(logprobs, params.top_k)
    # Explicit key instead of mlx-lm's categorical_sampling: that one draws from MLX's
    # global generator, which any other MLX user in the process would perturb.
    return mx.random.categorical(logprobs * (1.0 / params.temperature), key=key)[0]


# --------------------------------------------------------------------------- snapshots


@dataclass
class SessionState:
    """A complete, detached copy of a session: enough to continue bit-identically.

    Attributes:
        tokens: the token ids fed to the model (list of int).
        arrays: ``"logits"`` (float32 ``(vocab,)``, absent when no token was fed) and every
            KV-cache tensor as ``"cache.{layer}.{name}"``; names and shapes are the layer
            caches' own ``.state``. Safetensors-ready (no ``"tokens"`` entry; the file
            stores the ids as an int32 array under that name).
        meta: str → str (format, version, token count, layer count, model identity, …).
    """

    tokens: list[int]
    arrays: dict[str, mx.array]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes held by ``arrays`` (int)."""
        return sum(a.nbytes for a in self.arrays.values())

    def _payload(self, extra_meta: dict[str, str] | None) -> tuple[dict, dict]:
        arrays = dict(self.arrays)
        arrays[_TOKENS_KEY] = mx.array(self.tokens, dtype=mx.int32)
        meta = {**self.meta, **(extra_meta or {})}
        bad = [k for k, v in meta.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise TypeError(f"snapshot metadata must be str -> str; offending keys: {bad}")
        return arrays, meta

    def write(self, file: str | os.PathLike | io.IOBase, *, metadata: dict[str, str] | None = None):
        """Write as safetensors to a path or a binary file object.

        Args:
            file: destination; a path is written as given (no extension added).
            metadata: extra str → str entries merged over ``meta`` in the file header.
        """
        arrays, meta = self._payload(metadata)
        if isinstance(file, str | os.PathLike):
            # Through a file object: mx.save_safetensors appends ".safetensors" to paths.
            with open(file, "wb") as f:
                mx.save_safetensors(f, arrays, metadata=meta)
        else:
            mx.save_safetensors(file, arrays, metadata=meta)

    def to_bytes(self, *, metadata: dict[str, str] | None = None) -> bytes:
        """The safetensors encoding of this state (see ``write``)."""
        buf = io.BytesIO()
        self.write(buf, metadata=metadata)
        return buf.getvalue()

    @classmethod
    def read(cls, file: str | os.PathLike | io.IOBase) -> SessionState:
        """Read a state written by ``write`` from a path or a binary file object.

        Raises:
            SnapshotError: not a safetensors file, or not a ds4mlx session snapshot.
        """
        try:
            if isinstance(file, str | os.PathLike):
                # By path, so MLX reads the file itself (no Python-level buffering).
                arrays, meta = mx.load(os.fspath(file), format="safetensors", return_metadata=True)
            else:
                arrays, meta = mx.load(file, format="safetensors", return_metadata=True)
        except (OSError, RuntimeError, ValueError) as e:
            raise SnapshotError(f"cannot read session snapshot: {e}") from e
        if meta.get("format") != SNAPSHOT_FORMAT or _TOKENS_KEY not in arrays:
            raise SnapshotError("not a ds4mlx session snapshot")
        tokens = arrays.pop(_TOKENS_KEY).tolist()
        return cls(tokens=tokens, arrays=arrays, meta=dict(meta))

    @classmethod
    def from_bytes(cls, data: bytes) -> SessionState:
        """Inverse of ``to_bytes``. Raises ``SnapshotError``."""
        return cls.read(io.BytesIO(data))


# --------------------------------------------------------------------------- session


class Session:
    """The live inference state: token ids, per-layer KV caches, next-token logits.

    Attributes:
        engine: the owning ``Engine``.
        tokens: ids fed to the model so far (list of int; do not mutate).
        logits: float32 ``(vocab,)`` logits for the next token, or None before any token.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokens: list[int] = []
        self.logits: mx.array | None = None
        self.last_stop_reason: str | None = None
        self._cache = engine.model.make_cache()
        self._script: deque[int] | None = None
        self._key: mx.array | None = None

    # ---- bookkeeping

    @property
    def ctx_size(self) -> int:
        """The context size in tokens (the engine's)."""
        return self.engine.ctx_size

    def room(self) -> int:
        """Tokens that can still be fed before the context is full."""
        return self.ctx_size - len(self.tokens)

    def kv_bytes(self) -> int:
        """Bytes of KV-cache state held now (all layers: window, compressed rows, indexer
        rows, compressor frontiers)."""
        return int(sum(c.nbytes for c in self._cache))

    @property
    def text(self) -> str:
        """The text ``tokens`` decode to (computed on each access)."""
        return self.engine.tokenizer.decode(self.tokens)

    def reset(self) -> None:
        """Drop all state: no tokens, empty caches, no logits, no script, unseeded."""
        self.tokens = []
        self.logits = None
        self._cache = self.engine.model.make_cache()
        self._script = None
        self._key = None

    def _check_room(self, n: int) -> None:
        if len(self.tokens) + n > self.ctx_size:
            raise ContextOverflowError(len(self.tokens), n, self.ctx_size)

    def _cache_arrays(self) -> list[mx.array]:
        return [a for c in self._cache for a in c.state.values()]

    # ---- forward

    def _forward(self, tokens: list[int]) -> mx.array:
        """Feed ``tokens``; return float32 logits ``(vocab,)`` after the last one."""
        x = mx.array(tokens, dtype=mx.int32)[None]
        try:
            logits = self.engine._last_logits(x, self._cache)
            # Evaluate the cache too: its frontier state is not always on the logits'
            # graph, and a lazy graph would otherwise grow across calls.
            mx.eval(logits, self._cache_arrays())
        except BaseException:
            # The caches may hold part of this chunk: the only consistent state left is
            # the empty one. (KeyboardInterrupt included: callers keep the session.)
            self.reset()
            raise
        self.tokens.extend(tokens)
        self.logits = logits
        return logits

    def prefill(
        self,
        tokens: Iterable[int],
        *,
        chunk_size: int = DEFAULT_CHUNK,
        progress: Callable[[int, int], Any] | None = None,
        cancel: Callable[[], bool] | None = None,
    ) -> int:
        """Append ``tokens`` to the session in forward passes of ``chunk_size`` tokens.

        Only the logits after the last token of each chunk are computed (the vocab
        projection runs on one row); ``logits`` ends as the next-token logits.

        Args:
            tokens: ids to feed (int).
            chunk_size: tokens per forward pass (>= 1).
            progress: called as ``progress(done, total)`` before the first chunk and after
                each chunk (token counts of this call).
            cancel: polled before each chunk; returning True stops the prefill. The
                session then holds the chunks fed so far, consistently.
        Returns:
            The number of tokens fed (``len(tokens)`` unless cancelled).
        Raises:
            ContextOverflowError: the tokens do not fit; nothing is fed.
            ValueError: ``chunk_size`` < 1.
        On any error raised by the model itself the session is reset (its caches may
        hold part of a chunk) and the error propagates.
        """
        tokens = [int(t) for t in tokens]
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self._check_room(len(tokens))
        total = len(tokens)
        if progress is not None:
            progress(0, total)
        done = 0
        while done < total:
            if cancel is not None and cancel():
                break
            chunk = tokens[done : done + chunk_size]
            self._forward(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
        return done

    def decode(self, token: int) -> mx.array:
        """Feed one token; return (and store in ``logits``) the next-token logits.

        Raises:
            ContextOverflowError: the context is full.
        """
        self._check_room(1)
        return self._forward([int(token)])

    # ---- sampling

    def seed(self, seed: int | None) -> None:
        """(Re)seed the session's sampling generator; None draws a fresh random seed.

        Call at the start of each request whose ``SamplingParams.seed`` is set
        (``generate`` does): the same seed then reproduces the same tokens.
        """
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self._key = mx.random.key(seed)

    def set_script(self, tokens: Iterable[int] | None) -> None:
        """Scripted decoding (tests only): ``sample`` returns these ids, in order.

        The forward pass still runs for every token the caller feeds, so KV state,
        logits and usage stay real. When the script is exhausted normal sampling
        resumes. None clears the script.
        """
        self._script = None if tokens is None else deque(int(t) for t in tokens)

    @property
    def script_remaining(self) -> int:
        """Scripted tokens not yet returned by ``sample`` (0 when no script is set)."""
        return len(self._script) if self._script else 0

    def sample(self, params: SamplingParams, *, greedy: bool = False) -> int:
        """Pick the next token from ``logits`` (does not feed it; see ``decode``).

        Args:
            params: sampling settings; temperature 0 is argmax.
            greedy: force argmax (used while emitting protocol structure, DESIGN.md §4).
        Returns:
            The token id (int): the next scripted token when a script is set.
        Raises:
            RuntimeError: no logits yet (nothing was fed).
        """
        if self._script:
            tok = self._script.popleft()
            if not self._script:
                self._script = None
            return tok
        if self.logits is None:
            raise RuntimeError("no logits to sample from: feed a prompt first")
        if greedy or params.greedy:
            return int(mx.argmax(self.logits).item())
        if self._key is None:
            self.seed(params.seed)
        self._key, sub = mx.random.split(self._key)
        return int(_sample_token(self.logits, params, sub).item())

    def generate(
        self,
        prompt_tokens: Iterable[int],
        params: SamplingParams,
        max_tokens: int,
        *,
        stop_ids: Iterable[int] = (),
        chunk_size: int = DEFAULT_CHUNK,
        progress: Callable[[int, int], Any] | None = None,
        cancel: Callable[[], bool] | None = None,
    ) -> Iterator[int]:
        """Prefill ``prompt_tokens`` onto the current state, then sample and feed tokens.

        Yields each sampled id. Every yielded token is fed back (stop tokens included,
        so the live state matches a following turn's rendered prompt). Stops after a
        stop id, ``max_tokens`` tokens, a full context, or ``cancel()``; the reason is
        left in ``last_stop_reason`` ("stop", "length", "context", "cancelled").

        Raises:
            ContextOverflowError: the prompt itself does not fit.
        """
        stop = set(stop_ids)
        self.last_stop_reason = None
        fed = 0
        prompt = list(prompt_tokens)
        fed = self.prefill(prompt, chunk_size=chunk_size, progress=progress, cancel=cancel)
        if fed < len(prompt):
            self.last_stop_reason = "cancelled"
            return
        if params.seed is not None or self._key is None:
            self.seed(params.seed)
        for _ in range(max_tokens):
            if cancel is not None and cancel():
                self.last_stop_reason = "cancelled"
                return
            tok = self.sample(params)
            yield tok
            if self.room() == 0:
                self.last_stop_reason = "context"
                return
            self.decode(tok)
            if tok in stop:
                self.last_stop_reason = "stop"
                return
        self.last_stop_reason = "length"

    # ---- snapshots

    def snapshot(self) -> SessionState:
        """A detached copy of the full state (tokens, logits, every cache tensor).

        Later feeding does not affect the copy (arrays are copied and evaluated).
        """
        arrays: dict[str, mx.array] = {}
        if self.logits is not None:
            arrays[_LOGITS_KEY] = mx.array(self.logits)
        for i, c in enumerate(self._cache):
            for name, a in c.state.items():
                arrays[f"cache.{i}.{name}"] = mx.array(a)
        mx.eval(arrays)
        meta = {
            "format": SNAPSHOT_FORMAT,
            "version": SNAPSHOT_VERSION,
            "identity": self.engine.identity,
            "quant": self.engine.quant_desc,
            "n_tokens": str(len(self.tokens)),
            "n_layers": str(len(self._cache)),
        }
        return SessionState(tokens=list(self.tokens), arrays=arrays, meta=meta)

    def restore(self, state: SessionState) -> None:
        """Replace this session's state with a copy of ``state``.

        Any script and the sampling generator are kept as they are.

        Raises:
            SnapshotError: ``state`` comes from another model identity or cache layout,
                or its token count disagrees with its caches; the session is unchanged.
            ContextOverflowError: it holds more tokens than this context size.
        """
        ident = state.meta.get("identity")
        if ident is not None and ident != self.engine.identity:
            raise SnapshotError(
                f"snapshot is for model {ident}, this engine is {self.engine.identity}"
            )
        if len(state.tokens) > self.ctx_size:
            raise ContextOverflowError(0, len(state.tokens), self.ctx_size)
        caches = self.engine.model.make_cache()
        per_layer: list[dict[str, mx.array]] = [{} for _ in caches]
        for key, a in state.arrays.items():
            if key == _LOGITS_KEY:
                continue
            parts = key.split(".", 2)
            if len(parts) != 3 or parts[0] != "cache" or not parts[1].isdigit():
                raise SnapshotError(f"unexpected array {key!r} in snapshot")
            layer = int(parts[1])
            if layer >= len(caches):
                raise SnapshotError(f"snapshot has layer {layer}; the model has {len(caches)}")
            per_layer[layer][parts[2]] = mx.array(a)  # copy: the snapshot stays reusable
        try:
            for c, st in zip(caches, per_layer, strict=True):
                c.state = st
        except (KeyError, ValueError, TypeError) as e:
            raise SnapshotError(f"snapshot does not fit this model's caches: {e}") from e
        offsets = {getattr(c, "offset", len(state.tokens)) for c in caches}
        if offsets != {len(state.tokens)}:
            raise SnapshotError(
                f"snapshot holds {len(state.tokens)} tokens but its caches are at {offsets}"
            )
        logits = state.arrays.get(_LOGITS_KEY)
        if (logits is None) != (len(state.tokens) == 0):
            raise SnapshotError("snapshot logits do not match its token count")
        vocab = self.engine.args.vocab_size
        if logits is not None and tuple(logits.shape) != (vocab,):
            raise SnapshotError(f"snapshot logits have shape {logits.shape}, expected ({vocab},)")
        self._cache = caches
        self.tokens = list(state.tokens)
        self.logits = None if logits is None else mx.array(logits)
        mx.eval(self._cache_arrays(), *([self.logits] if self.logits is not None else []))


# --------------------------------------------------------------------------- engine


def describe_quant(model) -> str:
    """Human-readable quantization of ``model``: routed experts and the rest.

    Example: ``"experts=q4 other=q8"``, ``"experts=mxfp4 other=bf16"``, ``"f32"``.
    Derived from the loaded modules (``bits``/``mode`` of quantized layers, else the
    dtype of the weights), so it describes what actually runs.
    """
    buckets: dict[str, set[str]] = {"experts": set(), "other": set()}
    for name, mod in model.named_modules():
        routed = ".experts" in f".{name}" and "shared" not in name
        bucket = "experts" if routed else "other"
        bits = getattr(mod, "bits", None)
        if bits is not None and hasattr(mod, "scales"):
            mode = getattr(mod, "mode", "affine")
            buckets[bucket].add(f"q{bits}" if mode == "affine" else mode)
        elif hasattr(mod, "to_quantized") and isinstance(mod.get("weight"), mx.array):
            # Quantizable layers only: small float tables such as the router stay
            # unquantized in every checkpoint and would only add noise here.
            buckets[bucket].add(_dtype_name(mod["weight"].dtype))
    # Expert weights may be raw parameters of a container module rather than Linear
    # layers: fall back to parameter dtypes under "experts".
    if not buckets["experts"]:
        from mlx.utils import tree_flatten

        for name, p in tree_flatten(model.parameters()):
            if ".experts." in f".{name}" and "shared" not in name and p.ndim >= 2:
                if name.endswith(".scales"):
                    continue
                buckets["experts"].add(
                    _dtype_name(p.dtype) if p.dtype != mx.uint32 else "quantized"
                )
    exp = "+".join(sorted(buckets["experts"])) or "none"
    oth = "+".join(sorted(buckets["other"])) or "none"
    return exp if exp == oth else f"experts={exp} other={oth}"


def _dtype_name(dt) -> str:
    return {mx.float32: "f32", mx.bfloat16: "bf16", mx.float16: "f16"}.get(dt, str(dt))


def _model_identity(path: Path, config: dict, quant: str) -> str:
    """Stable id of a checkpoint: config, weight file names and sizes, quantization.

    File sizes rather than content hashes: hashing hundreds of GB at every start is
    not affordable, and a re-conversion changes the size or the config in practice.
    """
    h = hashlib.sha256()
    h.update(json.dumps(config, sort_keys=True).encode())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}\n".encode())
    h.update(quant.encode())
    return "ds4-" + h.hexdigest()[:16]


def default_ctx_size(max_positions: int | None) -> int:
    """The context size used when none is requested (see DEFAULT_CTX_*)."""
    cap = DEFAULT_CTX_GPU if mx.default_device() == mx.gpu else DEFAULT_CTX_CPU
    return min(max_positions, cap) if max_positions else cap


class Engine:
    """A loaded model and tokenizer, plus the single live session.

    Attributes:
        path: the checkpoint directory.
        model: the network (``ds4mlx.model.network.Model``).
        args: its ``ModelArgs``.
        config: the raw ``config.json`` dict.
        tokenizer: ``Tokenizer``.
        ctx_size: context size in tokens.
        identity: ``"ds4-<16 hex>"``, stable for the same checkpoint + quantization
            (used to key disk KV files).
        quant_desc: e.g. ``"experts=q2 other=q8"``.
        session: the live ``Session``.
    """

    def __init__(self, model, args, tokenizer: Tokenizer, *, path, config, ctx_size=None):
        self.path = Path(path)
        self.model = model
        self.args = args
        self.config = config
        self.tokenizer = tokenizer
        self.max_positions: int | None = _max_positions(args, config)
        if ctx_size is None:
            ctx_size = default_ctx_size(self.max_positions)
        if ctx_size < 1:
            raise ValueError(f"ctx_size must be >= 1, got {ctx_size}")
        if self.max_positions and ctx_size > self.max_positions:
            raise ValueError(
                f"ctx_size {ctx_size} exceeds the model's limit of {self.max_positions} tokens"
            )
        self.ctx_size = int(ctx_size)
        self.quant_desc = describe_quant(model)
        self.identity = _model_identity(self.path, config, self.quant_desc)
        self._last_logits = _last_logits_fn(model)
        self.session = Session(self)

    @classmethod
    def load(cls, path: str | os.PathLike, *, ctx_size: int | None = None, dtype=None) -> Engine:
        """Load the checkpoint directory ``path`` (config.json, *.safetensors, tokenizer).

        Args:
            path: checkpoint directory.
            ctx_size: context size in tokens; default ``default_ctx_size`` (the model's
                limit capped at 65536 on a GPU, 32768 on the CPU).
            dtype: compute dtype of unquantized weights; default bfloat16 on a GPU and
                float32 on the CPU, where MLX has no fast half-precision arithmetic.
        Raises:
            ds4mlx.model.loading.LoadError: unreadable or unsupported checkpoint.
            ds4mlx.tokenizer.TokenizerError: unusable tokenizer.
            ValueError: ``ctx_size`` out of range.
        """
        from ds4mlx.model.loading import load_model

        path = Path(path)
        if dtype is None:
            dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
        model, args = load_model(str(path), dtype=dtype)
        with open(path / "config.json") as f:
            config = json.load(f)
        return cls(model, args, Tokenizer.load(path), path=path, config=config, ctx_size=ctx_size)

    def new_session(self) -> Session:
        """A further, independent session on the same weights (tests, benchmarks)."""
        return Session(self)


def _max_positions(args, config: dict) -> int | None:
    for obj in (args, config):
        for name in ("max_position_embeddings", "max_seq_len"):
            v = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
            if v:
                return int(v)
    return None


def _last_logits_fn(model) -> Callable[[mx.array, list], mx.array]:
    """``f(tokens (1, L) int32, cache) -> float32 (vocab,)`` logits after the last token.

    Uses the network's ``last_only`` switch when it has one, so a prefill chunk runs the
    vocab projection (129280 × 4096 for Flash) on one row instead of ``L``.
    """
    try:
        last_only = "last_only" in inspect.signature(model.__call__).parameters
    except (TypeError, ValueError):
        last_only = False
    if last_only:
        return lambda x, cache: model(x, cache, last_only=True)[0, -1].astype(mx.float32)
    return lambda x, cache: model(x, cache)[0, -1].astype(mx.float32)
