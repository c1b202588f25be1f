"""The ``ds4mlx`` command line: serve, agent, generate, bench, tokenize, make-tiny, kv.

Each subcommand's arguments are declared here; its work lives in the room that owns
it (DESIGN.md §1). Modules are imported lazily so ``ds4mlx --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    print("ds4mlx make-tiny: not yet", file=sys.stderr)
    return 2


def _cmd_generate(args: argparse.Namespace) -> int:
    print("ds4mlx generate: not yet", file=sys.stderr)
    return 2


def _cmd_bench(args: argparse.Namespace) -> int:
    print("ds4mlx bench: not yet", file=sys.stderr)
    return 2


def _cmd_serve(args: argparse.Namespace) -> int:
    print("ds4mlx serve: not yet", file=sys.stderr)
    return 2


def _cmd_agent(args: argparse.Namespace) -> int:
    print("ds4mlx agent: not yet", file=sys.stderr)
    return 2


def _cmd_kv(args: argparse.Namespace) -> int:
    print("ds4mlx kv: not yet", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4mlx", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write a tiny DS4-architecture checkpoint")
    p.add_argument("dir")
    p.set_defaults(func=_cmd_make_tiny)

    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-p", "--prompt", required=True)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("bench", help="prefill/decode tokens/s at context frontiers")
    p.add_argument("-m", "--model", required=True)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("serve", help="OpenAI/Anthropic-compatible HTTP server")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("agent", help="terminal coding agent")
    p.set_defaults(func=_cmd_agent)

    p = sub.add_parser("kv", help="inspect the disk KV cache")
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
