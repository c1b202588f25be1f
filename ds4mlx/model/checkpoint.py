"""What a checkpoint directory holds, read from the safetensors headers only.

``scan`` lists every tensor (name, file, on-disk dtype, shape, bytes) without reading any
tensor data, so the fit check and the converter can plan before touching the weights.
The on-disk dtype matters because ``mx.load`` returns both of DeepSeek's 8-bit float
formats (``F8_E4M3`` weights, ``F8_E8M0`` scales) as plain ``uint8``.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass

from safetensors import SafetensorError, safe_open

from .errors import LoadError

# Bytes per element of each safetensors dtype string.
_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, as its safetensors header describes it.

    Attributes:
        name: tensor name as stored (not renamed).
        file: path of the ``.safetensors`` file holding it.
        dtype: safetensors dtype string (``"F8_E4M3"``, ``"BF16"``, ``"U32"`` ...).
        shape: tensor shape.
    """

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Stored elements (packed formats count their containers)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes on disk (and in memory once read, at this dtype)."""
        return self.numel * _ITEMSIZE.get(self.dtype, 4)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


def safetensors_files(path: str) -> list[str]:
    """Sorted ``*.safetensors`` files of directory ``path``."""
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def scan(path: str) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint directory ``path`` by name (headers only).

    Raises:
        OSError: an unreadable file.
        LoadError: a file whose header does not parse (truncated, empty, not safetensors:
            an interrupted download or copy), its path named.
        ValueError: the same tensor name in two files.
    """
    out: dict[str, TensorInfo] = {}
    for f in safetensors_files(path):
        try:
            with safe_open(f, "numpy") as st:
                for name in st.keys():
                    sl = st.get_slice(name)
                    if name in out:
                        raise ValueError(f"tensor {name} is in both {out[name].file} and {f}")
                    out[name] = TensorInfo(name, f, sl.get_dtype(), tuple(sl.get_shape()))
        except SafetensorError as e:
            raise LoadError(f"{f}: cannot read the safetensors header: {e}") from e
    return out


def read_config(path: str) -> dict:
    """``config.json`` of ``path`` as a dict.

    Raises:
        FileNotFoundError: no ``config.json``.
        json.JSONDecodeError: not JSON.
    """
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)
