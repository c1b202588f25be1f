"""``ds4mlx convert``: any loadable checkpoint or DeepSeek's FP8/FP4 release → ds4mlx's layout.

The output is exactly what ``network.Model`` holds, so loading it makes no copy: official
parameter names, routed experts stacked per layer (``ffn.experts.w1`` ``(E, inter, dim)``),
``wo_a`` in one piece, float tensors already in the compute dtype (the small
precision-critical ones in float32), MLX-quantized modules as ``.weight/.scales[/.biases]``,
and a ``config.json`` carrying mlx-lm's ``quantization`` dict (default spec + one entry per
module that differs), plus the tokenizer files.

Choices per part (``names.part_of``): routed experts (``expert``), everything else
(``rest``), and ``overrides`` for a part (``embed``, ``head``, ``attn``, ``indexer``,
``shared``, ``experts``) or a regular expression over module paths. A choice is a
``formats.QuantSpec``, None (unquantized, in ``dtype``) or ``"keep"`` (what the source has).

* From the release, ``mxfp4`` experts and ``mxfp8`` for the rest repack the stored bytes
  (lossless). Tensors the release ships in bf16/float32 (embedding, head, compressor,
  indexer ``weights_proj``) stay float under those default choices — re-quantizing them
  would lose precision the release has; an explicit override quantizes them anyway.
* Affine choices (2–8 bits) dequantize whatever is stored and quantize with MLX.
* A module already stored in the requested MLX quantization is copied as is.

Memory stays bounded: tensors are read lazily (``mx.load``), converted one layer at a time
and evaluated one output tensor at a time; finished tensors are written out once they fill
``shard_size``, so the peak is about one shard plus the tensor being built.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten

from .checkpoint import TensorInfo, read_config, scan
from .config import ModelArgs
from .errors import LoadError
from .formats import (
    MXFP4,
    MXFP8,
    QuantSpec,
    fp4_dequant,
    fp4_to_mxfp4,
    fp8_block_dequant,
    fp8_block_to_mxfp8,
    infer_mlx_spec,
    parse_spec,
)
from .identity import weights_metadata
from .names import KEEP_F32, LAYER, MTP, PER_EXPERT, WO_A_SPLIT, official_name, part_of
from .network import Model
from .units import format_bytes

PARTS = ("embed", "head", "attn", "indexer", "shared", "experts", "other")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_MODULE_SUFFIXES = ("weight", "scales", "biases", "scale")

Choice = QuantSpec | str | None  # a spec, None (float) or "keep"


class ConvertError(LoadError):
    """The source cannot be converted as asked (message says why)."""


@dataclass
class ConvertOptions:
    """What ``convert`` produces.

    Attributes:
        expert: choice for routed experts (spec string, see ``formats.parse_spec``); None:
            ``"keep"`` for a quantized source, else affine 4-bit.
        rest: choice for every other quantizable module; None: ``"keep"`` for a quantized
            source, else affine 8-bit.
        group_size: affine group size when a spec string gives none.
        overrides: ``(part or regex, spec string)`` pairs, applied in order (last wins).
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` for float tensors; None:
            bfloat16 where Metal runs, float32 on the CPU.
        shard_size: bytes per output shard.
        overwrite: replace an existing non-empty destination.
    """

    expert: str | None = None
    rest: str | None = None
    group_size: int = 64
    overrides: list[tuple[str, str]] = field(default_factory=list)
    dtype: str | None = None
    shard_size: int = 5_000_000_000
    overwrite: bool = False


@dataclass
class PartStats:
    """Output of one part: logical ``params``, stored ``bytes``, formats used."""

    params: int = 0
    bytes: int = 0
    formats: set[str] = field(default_factory=set)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.bytes / self.params if self.params else 0.0


@dataclass
class ConvertSummary:
    """What ``convert`` wrote: per-part stats, shards, timing, notes (dropped tensors ...)."""

    dst: str
    parts: dict[str, PartStats]
    shards: list[str]
    seconds: float
    notes: list[str] = field(default_factory=list)
    quantization: dict | None = None

    @property
    def total_bytes(self) -> int:
        return sum(p.bytes for p in self.parts.values())

    @property
    def total_params(self) -> int:
        return sum(p.params for p in self.parts.values())

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """``(part, formats, params, bytes, bits/weight)`` rows plus a total row."""
        out = []
        for name in PARTS:
            p = self.parts.get(name)
            if p and p.params:
                out.append(
                    (
                        name,
                        "+".join(sorted(p.formats)),
                        f"{p.params / 1e6:,.1f}M",
                        format_bytes(p.bytes),
                        f"{p.bits_per_weight:.2f}",
                    )
                )
        bpw = 8 * self.total_bytes / self.total_params if self.total_params else 0.0
        out.append(
            (
                "total",
                "",
                f"{self.total_params / 1e6:,.1f}M",
                format_bytes(self.total_bytes),
                f"{bpw:.2f}",
            )
        )
        return out


# --------------------------------------------------------------------------- planning
@dataclass
class _Ref:
    """One stored tensor feeding a module: its header info, and which half of a fused
    transformers ``gate_up_proj`` it is (0/1) when it is one."""

    info: TensorInfo
    half: int | None = None


@dataclass
class _Item:
    """One network module (or bare parameter) to produce.

    ``pieces`` maps a piece index (expert / wo_a group; None when stored whole) to its
    components (``weight``, ``scale``, ``scales``, ``biases``, or ``value`` for a bare
    parameter). ``join`` says how pieces combine: ``"stack"`` (experts) or ``"concat"``.
    """

    path: str
    pieces: dict[int | None, dict[str, _Ref]] = field(default_factory=lambda: defaultdict(dict))
    join: str | None = None

    @property
    def is_module(self) -> bool:
        return any("weight" in comps for comps in self.pieces.values())

    def source_bytes(self) -> int:
        return sum(r.info.nbytes for comps in self.pieces.values() for r in comps.values())

    def kind(self) -> str:
        """``"fp8"``, ``"fp4"`` (DeepSeek release), ``"mlx"`` (quantized), ``"float"``, ``"int"``."""
        comps = next(iter(self.pieces.values()))
        if "scale" in comps:
            return "fp8" if comps["weight"].info.dtype.startswith("F8") else "fp4"
        if "scales" in comps:
            return "mlx"
        ref = comps.get("weight") or comps.get("value")
        return "float" if ref.info.is_float else "int"


def _place(items: dict[str, _Item], name: str, info: TensorInfo) -> None:
    """File the stored tensor ``info`` (official name ``name``) under its module."""
    if m := PER_EXPERT.match(name):
        it = items.setdefault(f"{m.group(1)}.{m.group(3)}", _Item(f"{m.group(1)}.{m.group(3)}"))
        it.join = "stack"
        it.pieces[int(m.group(2))][m.group(4)] = _Ref(info)
        return
    if m := WO_A_SPLIT.match(name):
        it = items.setdefault(m.group(1), _Item(m.group(1)))
        it.join = "concat"
        it.pieces[int(m.group(2))][m.group(3)] = _Ref(info)
        return
    if name.endswith(".ffn.experts.gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        for half, w in ((0, "w1"), (1, "w3")):
            items.setdefault(base + w, _Item(base + w)).pieces[None]["weight"] = _Ref(info, half)
        return
    if name.endswith(".ffn.experts.down_proj"):
        name = name[: -len("down_proj")] + "w2.weight"
    base, _, suffix = name.rpartition(".")
    if suffix in _MODULE_SUFFIXES and base:
        items.setdefault(base, _Item(base)).pieces[None][suffix] = _Ref(info)
    else:
        items.setdefault(name, _Item(name)).pieces[None]["value"] = _Ref(info)


def plan(tensors: dict[str, TensorInfo], mtp: bool = False) -> tuple[list[list[_Item]], int]:
    """Group the checkpoint's tensors by module, modules by layer (top-level ones first,
    then the layers, then the MTP blocks).

    Returns ``(groups, dropped)``: each group is converted and written before the next is
    read; ``dropped`` counts tensors left out (``mtp.*`` unless ``mtp``).
    """
    items: dict[str, _Item] = {}
    dropped = 0
    for raw, info in sorted(tensors.items()):
        name = official_name(raw, mtp)
        if name is None:
            dropped += 1
            continue
        _place(items, name, info)
    by_layer: dict[int, list[_Item]] = defaultdict(list)
    for it in items.values():
        m, b = LAYER.match(it.path), MTP.match(it.path)
        by_layer[int(m.group(1)) if m else (1 << 20) + int(b.group(1)) if b else -1].append(it)
    return [by_layer[k] for k in sorted(by_layer)], dropped


# --------------------------------------------------------------------------- choices
class _Chooser:
    """Resolves the output format of each module from the options."""

    def __init__(self, opts: ConvertOptions, source_quantized: bool):
        gs = opts.group_size
        default_e = "keep" if source_quantized else "4"
        default_r = "keep" if source_quantized else "8"
        self.expert = parse_spec(opts.expert or default_e, gs)
        self.rest = parse_spec(opts.rest or default_r, gs)
        self.source_quantized = source_quantized
        self.kept_float: list[str] = []
        # (the override's key, its module matcher, its choice), in the order given
        self.overrides: list[tuple[str, Callable[[str], bool], Choice]] = []
        for key, spec in opts.overrides:
            choice = parse_spec(spec, gs)
            if key in PARTS:
                self.overrides.append((key, lambda p, k=key: part_of(p) == k, choice))
            else:
                try:
                    rx = re.compile(key)
                except re.error as e:
                    raise ConvertError(f"override {key!r}: not a part name or a regex: {e}") from e
                self.overrides.append((key, lambda p, rx=rx: rx.search(p) is not None, choice))

    def check_overrides(self, paths: list[str]) -> None:
        """Refuse an override that matches none of the modules ``paths``: a mistyped part
        (``haed``) or pattern would silently leave the module at its default.

        Raises:
            ConvertError: names the first such override and the part names.
        """
        for key, match, _ in self.overrides:
            if not any(match(p) for p in paths):
                raise ConvertError(
                    f"override {key!r} matches no module of this checkpoint (parts: "
                    f"{', '.join(sorted(PARTS))}; or a regex over module paths such as "
                    f"{paths[len(paths) // 2]!r})"
                )

    def choose(self, path: str) -> tuple[Choice, bool]:
        """``(choice, explicit)`` for module ``path``; explicit when an override matched."""
        for _, match, choice in reversed(self.overrides):
            if match(path):
                return choice, True
        return (self.expert if part_of(path) == "experts" else self.rest), False

    def resolve(self, item: _Item, stored: QuantSpec | None, in_dim: int) -> QuantSpec | None:
        """The spec to write for ``item`` (None: float), given what is ``stored``."""
        choice, explicit = self.choose(item.path)
        if choice == "keep":
            return stored
        if choice is None:
            return None
        # Microscaling defaults repack a quantized source; they never re-quantize a tensor
        # the source keeps in float (that would only lose precision the source has).
        if stored is None and choice.mode != "affine" and self.source_quantized and not explicit:
            return None
        if in_dim % choice.group_size:
            # MLX quantizes whole groups along the input: this module stays float.
            self.kept_float.append(
                f"{item.path} (input {in_dim} not a multiple of {choice.group_size})"
            )
            return None
        return choice


# --------------------------------------------------------------------------- conversion
def _load(refs: dict[str, _Ref], files: dict[str, dict[str, mx.array]]) -> dict[str, mx.array]:
    out = {}
    for comp, ref in refs.items():
        f = ref.info.file
        if f not in files:
            files[f] = mx.load(f)
        arr = files[f][ref.info.name]
        if ref.half is not None:
            n = arr.shape[-2] // 2
            arr = arr[..., ref.half * n : (ref.half + 1) * n, :]
        out[comp] = arr
    return out


def _stored_spec(kind: str, comps: dict[str, mx.array], in_dim: int) -> QuantSpec | None:
    if kind == "fp8":
        return MXFP8
    if kind == "fp4":
        return MXFP4
    if kind == "mlx":
        return infer_mlx_spec(
            comps["weight"].shape, comps["scales"].shape, in_dim, "biases" in comps
        )
    return None


def _dequant(kind: str, comps: dict[str, mx.array], stored: QuantSpec | None) -> mx.array:
    """float32 weight of one stored piece."""
    if kind == "fp8":
        return fp8_block_dequant(comps["weight"], comps["scale"])
    if kind == "fp4":
        return fp4_dequant(comps["weight"], comps["scale"])
    if kind == "mlx":
        return mx.dequantize(
            comps["weight"],
            comps["scales"],
            comps.get("biases"),
            group_size=stored.group_size,
            bits=stored.bits,
            mode=stored.mode,
            dtype=mx.float32,
        )
    return comps["weight"].astype(mx.float32)


def _convert_piece(kind, comps, stored, target, dtype) -> dict[str, mx.array]:
    """Output components of one piece: repacked, passed through, or re-quantized."""
    if target is not None and target == stored:
        if kind == "fp8":
            w, s = fp8_block_to_mxfp8(comps["weight"], comps["scale"])
            return {"weight": w, "scales": s}
        if kind == "fp4":
            w, s = fp4_to_mxfp4(comps["weight"], comps["scale"])
            return {"weight": w, "scales": s}
        out = dict(comps)  # same MLX quantization: copy; affine scales follow the dtype
        for k in ("scales", "biases"):
            if k in out and mx.issubdtype(out[k].dtype, mx.floating):
                out[k] = out[k].astype(dtype)
        return out
    w = _dequant(kind, comps, stored)
    if target is None:
        return {"weight": w.astype(dtype)}
    # Affine scales/biases come out in the input's dtype: quantize from the compute dtype
    # so loading needs no cast; microscaling scales are e8m0 bytes either way.
    src = w.astype(dtype) if target.mode == "affine" else w
    packed = mx.quantize(src, group_size=target.group_size, bits=target.bits, mode=target.mode)
    out = {"weight": packed[0], "scales": packed[1]}
    if len(packed) > 2 and packed[2] is not None:
        out["biases"] = packed[2]
    return out


def _join(join: str | None, pieces: list[dict[str, mx.array]]) -> dict[str, mx.array]:
    if join is None:
        return pieces[0]
    op = mx.stack if join == "stack" else mx.concatenate
    return {k: op([p[k] for p in pieces]) for k in pieces[0]}


class _Converter:
    """Converts one module at a time; knows the network's expected shapes."""

    def __init__(self, args: ModelArgs, chooser: _Chooser, dtype, mtp: str | None = None):
        """``mtp``: the drafter whose ``mtp.*`` tensors are converted (``"mtp"`` blocks or
        ``"dspark"`` stages, `ModelArgs.drafter`), or None."""
        skeleton = Model(args)  # lazy parameters: shapes only, nothing is allocated
        if mtp == "dspark":
            from .dspark import DSpark, DSparkConfig

            cfg = DSparkConfig.from_config(args.extra, args, args.n_mtp_layers)
            skeleton.mtp = DSpark(args, cfg).mtp  # the stages, named mtp.S.* as stored
        elif mtp:
            from .mtp import attach_mtp

            attach_mtp(skeleton)
        self.expected = dict(tree_flatten(skeleton.parameters()))
        self.quantizable = {p for p, m in skeleton.named_modules() if hasattr(m, "to_quantized")}
        self.args, self.chooser, self.dtype = args, chooser, dtype

    def mtp_problems(self, groups: list[list[_Item]]) -> list[str]:
        """What is wrong with the planned MTP tensors (``mtp.*``) against the config's MTP
        blocks: modules missing or not in the network (empty when they match)."""
        want = {
            k[: -len(".weight")] if k.endswith(".weight") else k
            for k in self.expected
            if k.startswith("mtp.")
        }
        have = {it.path for g in groups for it in g if it.path.startswith("mtp.")}
        return [f"{p} missing" for p in sorted(want - have)] + [
            f"{p} unexpected" for p in sorted(have - want)
        ]

    def module(self, item: _Item, files) -> tuple[dict[str, mx.array], QuantSpec | None, int]:
        """``(output tensors by parameter name, spec written, logical params)``."""
        if not item.is_module:
            return self._bare(item, files)
        wkey = f"{item.path}.weight"
        if wkey not in self.expected:
            raise ConvertError(f"{item.path}: the network has no such module (config mismatch?)")
        shape = self.expected[wkey].shape
        kind = item.kind()
        order = sorted(item.pieces, key=lambda k: -1 if k is None else k)
        self._check_pieces(item, order)
        loaded = [_load(item.pieces[k], files) for k in order]
        stored = _stored_spec(kind, loaded[0], shape[-1])
        target = None
        if item.path in self.quantizable:
            target = self.chooser.resolve(item, stored, shape[-1])
        dtype = mx.float32 if KEEP_F32.search(wkey) else self.dtype
        join = item.join
        if join is None and len(shape) == 3 and not (target is not None and target == stored):
            # Stacked experts to re-encode: one expert at a time, so only one expert's
            # float32 copy exists at once instead of the whole layer's.
            loaded = [{k: v[e] for k, v in loaded[0].items()} for e in range(shape[0])]
            join = "stack"
        outs = [_convert_piece(kind, c, stored, target, dtype) for c in loaded]
        if join is not None and target != stored:
            # Re-encoding piece by piece: evaluate each before building the next, so at
            # most one piece's float32 intermediates exist (MLX would otherwise schedule
            # several side by side).
            for out in outs:
                mx.eval(list(out.values()))
        joined = _join(join, outs)
        return {f"{item.path}.{k}": v for k, v in joined.items()}, target, _numel(shape)

    def _bare(self, item, files):
        arr = _load(item.pieces[None], files)["value"]
        if arr.dtype in (mx.float16, mx.bfloat16, mx.float32, mx.float64):
            arr = arr.astype(mx.float32 if KEEP_F32.search(item.path) else self.dtype)
        elif item.path.endswith(".gate.tid2eid") and arr.dtype != mx.int32:
            arr = arr.astype(mx.int32)
        return {item.path: arr}, None, arr.size

    def _check_pieces(self, item: _Item, order) -> None:
        if item.join == "stack":
            n = self.args.n_routed_experts
            missing = [e for e in range(n) if e not in item.pieces]
            if missing:
                raise ConvertError(f"{item.path}: experts {missing[:8]} missing")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# --------------------------------------------------------------------------- writing
class _ShardWriter:
    """Collects evaluated tensors and writes a shard whenever ``shard_size`` would overflow."""

    def __init__(self, dst: str, shard_size: int):
        self.dst, self.shard_size = dst, shard_size
        self.pending: dict[str, mx.array] = {}
        self.size = 0
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}

    def add(self, name: str, arr: mx.array) -> int:
        """Evaluate ``arr`` (reads and converts its sources) and queue it; returns its bytes."""
        mx.eval(arr)
        if self.pending and self.size + arr.nbytes > self.shard_size:
            self.flush()
        self.pending[name] = arr
        self.size += arr.nbytes
        return arr.nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        # A dot name: an interrupted conversion leaves nothing a loader's *.safetensors
        # glob would pick up.
        name = f".partial-{len(self.files) + 1:05d}.safetensors"
        # The weights digest (ds4mlx.model.identity): what the disk KV cache keys by.
        meta = weights_metadata(self.pending)
        mx.save_safetensors(os.path.join(self.dst, name), self.pending, metadata=meta)
        self.files.append(name)
        for k in self.pending:
            self.weight_map[k] = name
        self.pending, self.size = {}, 0
        mx.clear_cache()  # hand the freed buffers back instead of keeping them cached

    def finish(self) -> list[str]:
        """Flush, give shards their final names (``model.safetensors`` when only one),
        write ``model.safetensors.index.json``; returns the shard names."""
        self.flush()
        n = len(self.files)
        final = {}
        for i, f in enumerate(self.files):
            new = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.dst, f), os.path.join(self.dst, new))
            final[f] = new
        index = {
            "metadata": {
                "total_size": sum(
                    os.path.getsize(os.path.join(self.dst, f)) for f in final.values()
                )
            },
            "weight_map": {k: final[v] for k, v in sorted(self.weight_map.items())},
        }
        with open(os.path.join(self.dst, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
        return list(final.values())


# --------------------------------------------------------------------------- entry point
def _stream(groups, conv: _Converter, dst: str, shard_size: int, tensors, progress):
    """Convert and write every module; returns ``(shards, part stats, spec per module)``."""
    writer = _ShardWriter(dst, shard_size)
    parts: dict[str, PartStats] = defaultdict(PartStats)
    specs: dict[str, QuantSpec] = {}
    total = sum(t.nbytes for t in tensors.values())
    done = 0
    for group in groups:
        for item in group:
            files: dict[str, dict[str, mx.array]] = {}
            outs, spec, params = conv.module(item, files)
            del files  # only the output graphs reference the sources now
            stats = parts[part_of(item.path) if item.is_module else "other"]
            stats.params += params
            label = spec.label if spec else _dtype_label(outs)
            stats.formats.add(label)
            if spec is not None:
                specs[item.path] = spec
            for name in sorted(outs):
                stats.bytes += writer.add(name, outs.pop(name))
            done += item.source_bytes()
            if progress:
                progress(done, total, item.path)
    return writer.finish(), dict(parts), specs


def default_dtype() -> str:
    """bfloat16 where Metal runs (fast half precision), float32 on the CPU."""
    return "bfloat16" if mx.metal.is_available() else "float32"


def _prepare_dst(src: str, dst: str, overwrite: bool) -> None:
    """Make ``dst`` ready for the output (its old weights removed with ``overwrite``).

    Raises:
        ConvertError: ``dst`` is the source directory, by any path (a symlink to it
            too: its shards would be deleted before they are read), or is not empty
            without ``overwrite``.
    """
    if os.path.realpath(src) == os.path.realpath(dst) or (
        os.path.isdir(dst) and os.path.samefile(src, dst)
    ):
        raise ConvertError("destination must differ from the source")
    if os.path.isdir(dst) and os.listdir(dst):
        if not overwrite:
            raise ConvertError(f"{dst} exists and is not empty (use --overwrite to replace it)")
        for f in os.listdir(dst):
            if f.endswith((".safetensors", ".index.json")):
                os.remove(os.path.join(dst, f))
    os.makedirs(dst, exist_ok=True)


def _output_config(
    cfg: dict, specs: dict[str, QuantSpec], opts_note: dict
) -> tuple[dict, dict | None]:
    """``config.json`` for the output: the source's, with mlx-lm's ``quantization`` dict
    (the most common spec as default, one entry per module that differs)."""
    out = {k: v for k, v in cfg.items() if k not in ("quantization", "quantization_config")}
    out["ds4mlx_convert"] = opts_note
    if not specs:
        return out, None
    counts: dict[QuantSpec, int] = defaultdict(int)
    for s in specs.values():
        counts[s] += 1
    default = max(counts, key=lambda s: (counts[s], s.bits))
    q: dict = default.as_dict()
    for path, s in sorted(specs.items()):
        if s != default:
            q[path] = s.as_dict()
    out["quantization"] = q
    out["quantization_config"] = q  # mlx-lm writes both spellings
    return out, q


def _copy_tokenizer(src: str, dst: str, notes: list[str]) -> None:
    found = False
    for name in TOKENIZER_FILES:
        p = os.path.join(src, name)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(dst, name))
            found = found or name == "tokenizer.json"
    if not found:
        from .tiny import tokenizer_dir

        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(os.path.join(tokenizer_dir(), name), os.path.join(dst, name))
        notes.append("no tokenizer.json in the source: wrote the DeepSeek V4 tokenizer")


def convert(
    src: str,
    dst: str,
    opts: ConvertOptions | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> ConvertSummary:
    """Convert the checkpoint directory ``src`` into ds4mlx's layout in ``dst``.

    Args:
        src: any layout ``loading.load_model`` reads, or DeepSeek's FP8/FP4 release.
        dst: output directory (created; must be empty unless ``opts.overwrite``).
        opts: choices (see ``ConvertOptions``).
        progress: called as ``progress(done_bytes, total_bytes, module_path)`` after each
            module, in source bytes.

    Returns:
        the ``ConvertSummary`` (bytes and bits per weight per part).

    Raises:
        ConvertError / LoadError: unreadable source, unsupported model type, bad options,
            missing experts, or tensors the network does not have.
    """
    t0 = time.perf_counter()
    opts = opts or ConvertOptions()
    try:
        cfg = read_config(src)
        args = ModelArgs.from_dict(cfg)
        tensors = scan(src)
    except (OSError, ValueError, LoadError) as e:
        raise ConvertError(f"{src}: {e}") from e
    if not tensors:
        raise ConvertError(f"{src}: no *.safetensors files")
    dtype = _DTYPES[opts.dtype or default_dtype()]
    # The drafter's ``mtp.*`` (MTP blocks, or Flash 0731's DSpark stages) are kept and
    # quantized like the layers when the config declares it; stray ``mtp.*`` tensors of a
    # config without one are left out, and so are the DSpark tensors nothing reads.
    drafter = args.drafter
    keep_mtp = drafter is not None
    unused = _unused_drafter_tensors(tensors) if drafter == "dspark" else []
    tensors = {n: t for n, t in tensors.items() if n not in unused}
    groups, dropped = plan(tensors, keep_mtp)
    source_quantized = (
        any(n.endswith((".scale", ".scales")) for n in tensors) or "quantization" in cfg
    )
    chooser = _Chooser(opts, source_quantized)
    chooser.check_overrides([it.path for g in groups for it in g])
    try:
        conv = _Converter(args, chooser, dtype, drafter)
    except LoadError as e:  # a bad dspark_* field
        raise ConvertError(f"{src}: {e}") from e
    notes = [f"left out {len(unused)} DSpark tensors the drafter does not use"] if unused else []
    bad_mtp = conv.mtp_problems(groups) if keep_mtp else []
    if bad_mtp:
        # A malformed drafter is left out (the target converts; --speculative mtp then
        # says there is none), as the loader would refuse it.
        mtp_items = [it for g in groups for it in g if it.path.startswith("mtp.")]
        dropped += sum(len(c) for it in mtp_items for c in it.pieces.values())
        groups = [
            g for g in ([it for it in g if not it.path.startswith("mtp.")] for g in groups) if g
        ]
        notes.append(
            f"dropped the MTP tensors: malformed {'DSpark' if drafter == 'dspark' else 'MTP'}"
            f" drafter ({', '.join(bad_mtp[:4])}"
            f"{' …' if len(bad_mtp) > 4 else ''})"
        )
    _prepare_dst(src, dst, opts.overwrite)
    # Freed buffers go back to the system at once instead of into MLX's cache, so what the
    # process holds is what the current shard and tensor need.
    cache_limit = mx.set_cache_limit(0)
    try:
        shards, parts, specs = _stream(groups, conv, dst, opts.shard_size, tensors, progress)
    finally:
        mx.set_cache_limit(cache_limit)
        mx.clear_cache()
    if conv.chooser.kept_float:
        kept = conv.chooser.kept_float
        notes.append(
            f"kept float {len(kept)} modules: {', '.join(kept[:4])}{' …' if len(kept) > 4 else ''}"
        )
    if dropped and not bad_mtp:
        notes.append(
            f"dropped {dropped} MTP tensors (the config declares no MTP block: "
            "num_nextn_predict_layers 0)"
        )
    note = {
        "source": os.path.abspath(src),
        "expert": opts.expert or "default",
        "rest": opts.rest or "default",
        "overrides": [f"{k}={v}" for k, v in opts.overrides],
        "dtype": str(dtype).rsplit(".", 1)[-1],
    }
    out_cfg, q = _output_config(cfg, specs, note)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(out_cfg, f, indent=2)
    _copy_tokenizer(src, dst, notes)
    return ConvertSummary(dst, parts, shards, time.perf_counter() - t0, notes, q)


def _unused_drafter_tensors(tensors: dict[str, TensorInfo]) -> list[str]:
    """Stored names of the DSpark tensors the proposal never reads (``dspark_loading.UNUSED``)."""
    from .dspark_loading import UNUSED

    return [n for n in tensors if UNUSED.match(official_name(n, mtp=True) or "")]


def _dtype_label(outs: dict[str, mx.array]) -> str:
    dt = next(iter(outs.values())).dtype
    return {mx.float32: "f32", mx.bfloat16: "bf16", mx.float16: "f16"}.get(
        dt, str(dt).rsplit(".", 1)[-1]
    )
