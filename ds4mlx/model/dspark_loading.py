"""Loading the DSpark drafter (``mtp.*`` tensors, ``dspark_*`` config fields) of a
checkpoint directory; the network is ``dspark.py``."""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .dspark import DSpark, DSparkConfig
from .errors import LoadError
from .loading import _check_names_and_shapes, _quant_predicate, _read_weights, _scan, sanitize
from .names import KEEP_F32

# Tensors some DSpark checkpoints carry that the proposal does not use: a confidence head
# (a learned early stop of the block) and a gate bias of unknown role. Dropped at load.
UNUSED = re.compile(r"^mtp\.\d+\.(confidence_head\..*|ffn\.gate\.bias_vl)$")
_STAGE = re.compile(r"^mtp\.(\d+)\.")


def _stages(names) -> int:
    """Stage count of the ``mtp.S.*`` names. Raises LoadError unless they are 0 … N-1."""
    found = sorted({int(m.group(1)) for n in names if (m := _STAGE.match(n))})
    if found != list(range(len(found))):
        raise LoadError(f"DSpark stages must be mtp.0 … mtp.N-1, found mtp.{found}")
    return len(found)


def _sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
    """The loader's own renaming / expert stacking (``loading.sanitize``) applied to the
    stages, by naming ``mtp.S`` ``layers.S`` for the call."""
    as_layers = {"layers." + k[len("mtp.") :]: v for k, v in weights.items()}
    return {"mtp." + k[len("layers.") :]: v for k, v in sanitize(as_layers, args).items()}


def load_dspark(
    path: str, args: ModelArgs, target, cfg_json: dict, *, required: bool = True
) -> DSpark | None:
    """The DSpark drafter of the checkpoint directory ``path``, attached to ``target``
    (its ``network.Model``); None when ``cfg_json`` declares none, or (``required``
    False) when the directory has no ``mtp.*`` tensors at all (a conversion that
    dropped them).

    Weights stay lazy; quantized ones are read as the target's are (``quantization``
    entries keyed ``mtp.S.…``), floats go to the target's compute dtype (norms, router and
    mHC stay float32).

    Raises:
        LoadError: a declared drafter without ``mtp.*`` tensors (``required``), a bad
            config field, or a
            malformed tensor set (the message names the missing, unexpected or misshapen
            tensor).
    """
    if cfg_json.get("dspark_block_size") in (None, 0):
        return None
    tensors = {
        n.removeprefix("model."): t
        for n, t in _scan(path).items()
        if n.removeprefix("model.").startswith("mtp.")
    }
    if not tensors and not required:
        return None
    if not tensors:
        raise LoadError(f"{path}: config.json declares a DSpark drafter but has no mtp.* tensors")
    cfg = DSparkConfig.from_config(cfg_json, args, _stages(tensors))
    declared = args.n_mtp_layers
    if declared and declared != cfg.n_stages:
        raise LoadError(
            f"{path}: num_nextn_predict_layers is {declared} but the checkpoint has "
            f"DSpark stages mtp.0 … mtp.{cfg.n_stages - 1}"
        )
    raw = {n.removeprefix("model."): a for n, a in _read_weights(path, tensors).items()}
    weights = _sanitize(
        {n: a for n, a in raw.items() if n.startswith("mtp.") and not UNUSED.match(n)}, args
    )
    net = DSpark(args, cfg)
    if any(k.endswith(".scales") for k in weights):
        q = args.quantization or cfg_json.get("quantization_config") or {}
        nn.quantize(
            net,
            group_size=q.get("group_size", 64),
            bits=q.get("bits", 8),
            mode=q.get("mode", "affine"),
            class_predicate=_quant_predicate(q, weights),
        )
    _cast(weights, target.compute_dtype)
    _check_names_and_shapes(path, net, weights)
    net.load_weights(list(weights.items()), strict=True)
    net.eval()
    net.attach(target)
    return net


def _cast(weights: dict[str, mx.array], dtype) -> None:
    for k, v in list(weights.items()):
        if mx.issubdtype(v.dtype, mx.floating):
            want = mx.float32 if KEEP_F32.search(k) else dtype
            if v.dtype != want:
                weights[k] = v.astype(want)
