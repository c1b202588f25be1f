"""A checkpoint's identity from the content of its weights.

The disk KV cache keys every snapshot by the engine's identity (``Engine.identity``); a
snapshot restored into other weights would answer as neither model does. So the
identity must change when any tensor changes — a fine-tune, a re-conversion with other
options, another seed — while a start of a 150 GB checkpoint cannot afford to read it
all. Two sources, both per ``*.safetensors`` file:

* **The weights digest** (`DIGEST_KEY` in the file's safetensors metadata):
  ``sha256`` over every tensor in name order — ``name NUL dtype NUL shape NUL raw
  bytes`` (dtype as the safetensors header spells it, shape as comma-separated ints) —
  written by ``ds4mlx convert`` and ``ds4mlx make-tiny`` (`weights_metadata`) from the
  arrays they save, so it covers every byte. `file_digest` recomputes it from a file.
  Tools that rewrite a file (mlx-lm, ``save_pretrained``) write their own metadata, so a
  fine-tuned file does not carry a stale digest.
* **Sampled bytes of every tensor**, read through the header's data offsets: a tensor of
  at most ``3 × SAMPLE_BYTES`` is read whole, a larger one at its start, middle and end
  (``SAMPLE_BYTES`` each). A fine-tune changes (nearly) every value of a tensor it
  trains, so any window catches it. Read on every start, digest or not: they make a
  stale digest (a tool that changed tensors but copied the metadata) harmless, and a
  checkpoint without a digest still gets a content identity.

Cost: the header of each file plus at most ``3 × 4 KiB`` per tensor. A Flash checkpoint
in ds4mlx's quantized layout holds about 2,600 tensors (``make_tiny(layers=43)`` writes
the same tensor list: 2,610): at most about 7,800 reads, 32 MiB, sorted by offset within
each file — a fraction of a second on an SSD, and nothing next to the 150 GB the first
forward pass reads (the 43-layer tiny checkpoint: 3.9 MB read, 60 ms). The digest costs
``convert`` one sha256 pass over what it writes (about 1 GB/s per core).

Also hashed: each file's name, size and whole header (tensor names, dtypes, shapes,
offsets, metadata). ``Engine`` adds ``config.json`` and the quantization it loaded.
Stdlib only (reads the safetensors header itself: 8-byte little-endian length, JSON).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import mlx.core as mx

DIGEST_KEY = "ds4mlx.weights_sha256"
SAMPLE_BYTES = 4096
_MAX_HEADER = 100 * 2**20  # safetensors readers refuse larger headers

_ST_DTYPES = {
    mx.bool_: "BOOL", mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16", mx.int16: "I16",
    mx.uint32: "U32", mx.int32: "I32", mx.uint64: "U64", mx.int64: "I64",
    mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32", mx.float64: "F64",
}  # fmt: skip


def _tensor_head(name: str, dtype: str, shape) -> bytes:
    return f"{name}\0{dtype}\0{','.join(str(int(d)) for d in shape)}\0".encode()


def weights_digest(weights: Mapping[str, mx.array]) -> str:
    """The `DIGEST_KEY` value of a file holding ``weights``: sha256 hex over every tensor
    in name order (``name NUL dtype NUL shape NUL bytes``). Evaluates the arrays."""
    h = hashlib.sha256()
    for name in sorted(weights):
        a = weights[name]
        h.update(_tensor_head(name, _ST_DTYPES[a.dtype], a.shape))
        if a.size:
            h.update(memoryview(mx.contiguous(a)))
    return h.hexdigest()


def weights_metadata(weights: Mapping[str, mx.array]) -> dict[str, str]:
    """The safetensors metadata ds4mlx writes with checkpoint weights:
    ``{"format": "mlx", DIGEST_KEY: weights_digest(weights)}``."""
    return {"format": "mlx", DIGEST_KEY: weights_digest(weights)}


def _read_header(f) -> tuple[bytes, dict, int]:
    """``(header bytes, parsed header, offset of the data)`` of an open safetensors file.

    Raises:
        ValueError: not a safetensors file.
    """
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError("too short for a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER:
        raise ValueError(f"header of {n} bytes")
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated header")
    return data, json.loads(data), 8 + n


def _tensors(header: dict) -> list[tuple[str, dict]]:
    return [(k, v) for k, v in header.items() if k != "__metadata__"]


def file_digest(path: str | os.PathLike) -> str:
    """`weights_digest` recomputed from the file ``path`` (reads every byte).

    Raises:
        OSError: unreadable. ValueError: not a safetensors file.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        _, header, base = _read_header(f)
        for name, info in sorted(_tensors(header)):
            start, end = info["data_offsets"]
            h.update(_tensor_head(name, info["dtype"], info["shape"]))
            f.seek(base + start)
            left = end - start
            while left:
                chunk = f.read(min(left, 1 << 24))
                if not chunk:
                    raise ValueError(f"{path}: tensor {name} runs past the end of the file")
                h.update(chunk)
                left -= len(chunk)
    return h.hexdigest()


def _windows(start: int, end: int) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` of the sampled bytes of the tensor at ``[start, end)``."""
    n = end - start
    if n <= 3 * SAMPLE_BYTES:
        if n:
            yield start, n
        return
    mid = start + (n // 2 // SAMPLE_BYTES) * SAMPLE_BYTES
    yield start, SAMPLE_BYTES
    yield mid, SAMPLE_BYTES
    yield end - SAMPLE_BYTES, SAMPLE_BYTES


def file_identity(path: str | os.PathLike) -> tuple[str, int]:
    """The content part of one safetensors file's identity: sha256 hex over its name,
    size, whole header (metadata and any `DIGEST_KEY` included) and the sampled bytes of
    every tensor; with the number of bytes read.

    Raises:
        OSError: unreadable. ValueError: not a safetensors file.
    """
    path = Path(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw, header, base = _read_header(f)
        h.update(f"{path.name}\0{size}\0".encode())
        h.update(raw)
        spans = sorted(w for _, info in _tensors(header) for w in _windows(*info["data_offsets"]))
        read = len(raw) + 8
        for off, n in spans:
            chunk = os.pread(f.fileno(), n, base + off)
            h.update(chunk)
            read += len(chunk)
    return h.hexdigest(), read


def checkpoint_identity(path: str | os.PathLike) -> str:
    """sha256 hex over `file_identity` of every ``*.safetensors`` in the checkpoint
    directory ``path``, in name order (``Engine`` adds config and quantization).

    Raises:
        OSError: unreadable. ValueError: a file is not safetensors.
    """
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(file_identity(f)[0].encode())
    return h.hexdigest()
