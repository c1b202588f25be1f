"""Load a DeepSeek V4 checkpoint directory into ``network.Model``.

A directory holds ``config.json`` and ``*.safetensors`` (optionally ``tokenizer.json``).
Supported layouts, detected from the tensor names (``names.py`` maps them):

(a) transformers names (``model.layers.N.self_attn.q_a_proj.weight``, stacked
    ``mlp.experts.gate_up_proj`` / ``down_proj``, ``model.embed_tokens``, ``lm_head``);
    also the mixed names ``save_pretrained`` of transformers 5 writes (official names
    under a ``model.`` prefix, per-expert ``ffn.experts.E.w1``, ``attn.norm`` for the
    attention's ``kv_norm``);
(b) DeepSeek's official names (``embed``, ``layers.N.attn.wq_a`` …, per-expert
    ``ffn.experts.E.w{1,2,3}`` or pre-stacked ``ffn.experts.w{1,2,3}``), float weights;
(c) (b) MLX-quantized: ``.weight/.scales[/.biases]`` triples, with the ``quantization``
    dict of ``config.json`` in mlx-lm's format (``group_size``, ``bits``, optional
    ``mode``, per-module overrides keyed by module path, ``false`` = not quantized).
    ``wo_a`` may be split per group (``attn.wo_a.G.*``).

``ds4mlx convert`` writes layout (c) exactly as the network holds it (experts stacked,
floats in the compute dtype), and then loading makes no copy: ``mx.load`` gives lazy
arrays that MLX reads (``pread``) straight into their own buffers on first use. Other
layouts load too, at the cost of one copy of what must be stacked or cast; the loader
says so. DeepSeek's raw FP8/FP4 release must be converted first (``ds4mlx convert``).

Before any weight is read, ``fit.check_fit`` compares weights + KV + working memory with
the device's memory and refuses with the numbers when it does not fit.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .checkpoint import TensorInfo, safetensors_files, scan
from .config import ModelArgs
from .errors import FitError, LoadError
from .fit import check_fit
from .names import KEEP_F32, PER_EXPERT, WO_A_SPLIT, is_mtp, official_name
from .network import Model
from .units import format_bytes

__all__ = ["FitError", "LoadError", "load_model", "official_name", "read_config", "sanitize"]

log = logging.getLogger("ds4mlx.model")

# Former private names of the rename tables (now in names.py), for code that used them.
_KEEP_F32, _PER_EXPERT, _WO_A_SPLIT = KEEP_F32, PER_EXPERT, WO_A_SPLIT


def is_raw_release(cfg: dict, tensors: dict[str, TensorInfo]) -> bool:
    """DeepSeek's FP8/FP4 release: ``X.scale`` companions (or an fp8/fp4 quant method and
    no MLX ``quantization`` dict)."""
    qc = cfg.get("quantization_config") or {}
    if "quantization" not in cfg and str(qc.get("quant_method", "")).lower() in ("fp8", "fp4"):
        return True
    return any(n.endswith(".scale") and n[: -len(".scale")] + ".weight" in tensors for n in tensors)


def sanitize(
    weights: dict[str, mx.array], args: ModelArgs, mtp: bool = False
) -> dict[str, mx.array]:
    """Turn checkpoint tensors (any supported layout) into ``Model`` parameter names.

    ``mtp``: keep the MTP blocks' ``mtp.*`` tensors (else they are dropped).

    Renames transformers names, splits ``experts.gate_up_proj`` into ``w1``/``w3``, stacks
    per-expert tensors into ``(E, …)`` arrays, joins a per-group split ``wo_a`` and casts
    ``tid2eid`` to int32. Tensors already in the network's layout pass through untouched.

    Raises:
        LoadError: an expert is missing from a per-expert layout.
    """
    out: dict[str, mx.array] = {}
    experts: dict[tuple[str, str, str], dict[int, mx.array]] = defaultdict(dict)
    wo_a: dict[tuple[str, str], dict[int, mx.array]] = defaultdict(dict)
    for raw, arr in weights.items():
        name = official_name(raw, mtp)
        if name is None:
            continue
        if m := PER_EXPERT.match(name):
            experts[(m.group(1), m.group(3), m.group(4))][int(m.group(2))] = arr
        elif m := WO_A_SPLIT.match(name):
            wo_a[(m.group(1), m.group(3))][int(m.group(2))] = arr
        elif name.endswith(".ffn.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = arr.shape[1] // 2
            out[base + "w1.weight"] = arr[:, :inter]
            out[base + "w3.weight"] = arr[:, inter:]
        elif name.endswith(".ffn.experts.down_proj"):
            out[name[: -len("down_proj")] + "w2.weight"] = arr
        elif name.endswith(".gate.tid2eid") and arr.dtype != mx.int32:
            out[name] = arr.astype(mx.int32)
        else:
            out[name] = arr
    for (base, w, suffix), parts in experts.items():
        n = args.n_routed_experts
        missing = [e for e in range(n) if e not in parts]
        if missing:
            raise LoadError(f"{base}: experts {missing[:8]} missing for {w}.{suffix}")
        out[f"{base}.{w}.{suffix}"] = mx.stack([parts[e] for e in range(n)])
    for (base, suffix), parts in wo_a.items():
        out[f"{base}.{suffix}"] = mx.concatenate([parts[g] for g in sorted(parts)])
    return out


def _quant_predicate(qcfg: dict, weights: dict[str, mx.array]):
    """mlx-lm's rule: a per-module entry wins; else quantize where ``.scales`` exist."""

    # Per-module entries may use checkpoint spellings ("model." prefix, transformers
    # names) or name single experts, which the network holds stacked.
    def module_path(key: str) -> str:
        name = official_name(key + ".weight", mtp=True) or key + ".weight"
        if m := PER_EXPERT.match(name):
            return f"{m.group(1)}.{m.group(3)}"
        return name[: -len(".weight")]

    qcfg = {module_path(k): v for k, v in qcfg.items() if isinstance(v, (bool, dict))}

    def pred(path: str, module: nn.Module):
        if path in qcfg:
            return qcfg[path]
        if not hasattr(module, "to_quantized"):
            return False
        return f"{path}.scales" in weights

    return pred


def read_config(path: str) -> dict:
    """``config.json`` of ``path``.

    Raises:
        LoadError: ``path`` missing or not a directory, ``config.json`` missing or not JSON.
    """
    import json

    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise LoadError(f"{path} does not exist")
    if not os.path.isdir(path):
        raise LoadError(f"{path} is not a directory (give the checkpoint's directory)")
    if not os.path.isfile(cfg_path):
        raise LoadError(f"{path}: no config.json (not a checkpoint directory)")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except ValueError as e:
        raise LoadError(f"{cfg_path}: not JSON: {e}") from e


def parse_config(path: str, cfg: dict) -> ModelArgs:
    """``ModelArgs`` of ``cfg``, refusing other model generations with a clear message.

    Raises:
        LoadError: unsupported ``model_type`` or an inconsistent config.
    """
    try:
        return ModelArgs.from_dict(cfg)
    except ValueError as e:
        raise LoadError(f"{path}: {e}") from e


def _scan(path: str) -> dict[str, TensorInfo]:
    if not safetensors_files(path):
        raise LoadError(f"{path}: no *.safetensors files")
    try:
        return scan(path)
    except (OSError, ValueError) as e:
        raise LoadError(f"{path}: cannot read the safetensors headers: {e}") from e


def _announce(path: str, tensors: dict[str, TensorInfo], dtype, mtp: bool) -> None:
    """Say once per load what will cost a copy: restacking per-expert tensors, casting floats."""
    per_expert = restack = 0
    cast = 0
    want = {mx.float32: "F32", mx.bfloat16: "BF16", mx.float16: "F16"}.get(dtype)
    for t in tensors.values():
        name = official_name(t.name, mtp)
        if name is None:
            continue
        if PER_EXPERT.match(name):
            per_expert += 1
            restack += t.nbytes
        if t.is_float and t.dtype != ("F32" if KEEP_F32.search(name) else want):
            cast += t.nbytes
    if per_expert:
        log.warning(
            "%s stores routed experts one tensor per expert (%d tensors, %s): stacking them "
            "makes a copy at load; convert once with `ds4mlx convert %s DST` to load without it",
            path,
            per_expert,
            format_bytes(restack),
            path,
        )
    if cast:
        log.warning(
            "%s: casting %s of float weights to %s%s; `ds4mlx convert --dtype %s` stores them "
            "that way",
            path,
            format_bytes(cast),
            str(dtype).rsplit(".", 1)[-1],
            " (the CPU has no fast half-precision arithmetic)" if dtype == mx.float32 else "",
            str(dtype).rsplit(".", 1)[-1],
        )


def _read_weights(path: str, tensors: dict[str, TensorInfo]) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for f in sorted({t.file for t in tensors.values()}):
        try:
            weights.update(mx.load(f))
        except Exception as e:  # noqa: BLE001 — report which file is unreadable
            raise LoadError(f"{f}: cannot read safetensors: {e}") from e
    return weights


def _quantize_model(path: str, model: Model, args: ModelArgs, cfg: dict, weights) -> None:
    q = args.quantization or cfg.get("quantization_config")
    if not isinstance(q, dict) or "bits" not in q:
        raise LoadError(f"{path}: quantized tensors but no 'quantization' entry in config.json")
    nn.quantize(
        model,
        group_size=q.get("group_size", 64),
        bits=q["bits"],
        mode=q.get("mode", "affine"),
        class_predicate=_quant_predicate(q, weights),
    )


def _check_names_and_shapes(path: str, model: Model, weights: dict[str, mx.array]) -> None:
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    bad = [n for n in missing + extra if n.startswith("mtp.")]
    bad += [
        f"{k} has shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}"
        for k, v in weights.items()
        if k.startswith("mtp.") and k in expected and v.shape != expected[k].shape
    ]
    if bad:
        what = [f"{n} missing" if n in missing else n for n in bad]
        what = [f"{n} unexpected" if n in extra else n for n in what]
        kind = "DSpark" if model.args.drafter == "dspark" else "MTP"
        raise LoadError(
            f"{path}: malformed {kind} drafter (mtp.*, num_nextn_predict_layers "
            f"{model.args.n_mtp_layers}): {', '.join(what[:6])}{' …' if len(what) > 6 else ''}"
        )
    if missing or extra:
        raise LoadError(
            f"{path}: checkpoint does not match the config: missing {missing[:6]}"
            f"{' …' if len(missing) > 6 else ''}, unexpected {extra[:6]}{' …' if len(extra) > 6 else ''}"
        )
    for k, v in weights.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise LoadError(
                f"{path}: {k} has shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}"
            )


def load_model(
    path: str,
    *,
    dtype=mx.float32,
    ctx_size: int | None = None,
    sessions: int = 1,
    memory_limit: int | str | None = None,
    check_memory: bool = True,
    mtp: bool = False,
    dspark: bool = False,
) -> tuple[Model, ModelArgs]:
    """Load ``path`` (directory with ``config.json`` + ``*.safetensors``).

    Args:
        path: checkpoint directory.
        dtype: compute dtype for unquantized floating parameters (float32 on the CPU).
        ctx_size: context the caller will use, for the fit check (default: the engine's
            default context).
        sessions: session states the caller keeps resident, for the fit check.
        memory_limit: bytes or a size string overriding the device memory in the fit
            check (else ``$DS4MLX_MEMORY_LIMIT``).
        check_memory: run the fit check (tools that only inspect weights may skip it).
        mtp: also load the checkpoint's MTP drafter (``model.mtp``, `ds4mlx.model.mtp`)
            when it has one (``num_nextn_predict_layers`` > 0 and ``mtp.*`` tensors);
            otherwise those tensors are neither read nor counted. Never on a checkpoint
            whose ``mtp.*`` is a DSpark drafter (``ModelArgs.drafter``).
        dspark: count the checkpoint's DSpark drafter (``mtp.*`` of a config with
            ``dspark_block_size``) in the fit check: ``ds4mlx.engine.dspark`` loads it.

    Returns:
        ``(model, args)``; weights stay lazy (read from the files on first use).

    Raises:
        FitError: weights + KV + working memory exceed the device (before any weight is read).
        LoadError: missing files, unsupported ``model_type``, DeepSeek's raw FP8/FP4 release
            (needs ``ds4mlx convert``), or tensors that do not match the config (names in
            the message; a malformed ``mtp.*`` set when ``mtp``).
    """
    path = str(path)
    cfg = read_config(path)
    args = parse_config(path, cfg)
    tensors = _scan(path)
    if is_raw_release(cfg, tensors):
        raise LoadError(
            f"{path}: DeepSeek's FP8/FP4 release format ('.scale' tensors) is not loaded "
            f"directly; convert it once: ds4mlx convert {path} DST  (lossless with "
            "--expert-mode mxfp4 --bits mxfp8, smaller with --expert-bits 2|3|4)"
        )
    kind = args.drafter if any(is_mtp(n) for n in tensors) else None
    mtp = mtp and kind == "mtp"  # a DSpark checkpoint's mtp.* are no MTP blocks
    drafter = mtp or (dspark and kind == "dspark")
    if check_memory:
        try:
            check_fit(
                path,
                ctx_size,
                sessions,
                memory_limit,
                dtype_bytes=dtype.size,
                gpu=mx.default_device() == mx.gpu,
                mtp=drafter,
            )
        except ValueError as e:
            raise LoadError(f"{path}: {e}") from e
    _announce(path, tensors, dtype, drafter)
    weights = sanitize(_read_weights(path, tensors), args, mtp)
    model = Model(args)
    if mtp:
        from .mtp import attach_mtp

        attach_mtp(model)
    if any(k.endswith(".scales") for k in weights):
        _quantize_model(path, model, args, cfg, weights)
    # Float parameters go to the compute dtype; packed weights and int tables stay. The
    # small precision-critical tensors stay float32 whatever the compute dtype.
    for k, v in list(weights.items()):
        if mx.issubdtype(v.dtype, mx.floating):
            want = mx.float32 if KEEP_F32.search(k) else dtype
            if v.dtype != want:
                weights[k] = v.astype(want)
    model.compute_dtype = dtype
    _check_names_and_shapes(path, model, weights)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    return model, args
