"""``ds4mlx kv ls|show|rm``: inspect and prune a disk KV cache directory.

Read-only except ``rm``; safe to run while a server writes to the same directory (files
that appear or vanish mid-listing are simply listed or not). ``rm`` unlinks whole
files, which a running server treats as a miss. A directory may hold the snapshots of
several models (keys are per model identity and context size: ``ds4mlx.kv.store``);
``ls`` lists them all, ``ls -l`` names each one's model identity and context.

The parser part is imported by ``ds4mlx --help``; mlx, the store and rich load only when
a ``kv`` command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ds4mlx.argtypes import positive_int
from ds4mlx.sanitize import escape_controls

if TYPE_CHECKING:  # imported lazily: build_parser() imports this module on every run
    from rich.console import Console


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add the ``ls``/``show``/``rm`` subcommands to the ``kv`` parser."""
    sub = p.add_subparsers(dest="kv_command", required=True, metavar="{ls,show,rm}")
    from ds4mlx.kv.policy import default_disk_dir

    q = sub.add_parser("ls", help="list snapshots (tokens, hits, age, reason, size, text)")
    q.add_argument(
        "dir", nargs="?", default=str(default_disk_dir()),
        help="cache directory (default: the server's, %(default)s)",
    )  # fmt: skip
    q.add_argument(
        "--verify", action="store_true", help="also check every tensor's digest (reads all)"
    )
    q.add_argument("-l", "--long", action="store_true", help="also show context and model")
    q = sub.add_parser("show", help="one snapshot's header and the start of its text")
    q.add_argument("dir")
    q.add_argument("key", help="SHA-1 key or a unique prefix of it")
    q.add_argument("--chars", type=positive_int, default=2000, help="text characters to print")
    q = sub.add_parser("rm", help="remove snapshots")
    q.add_argument("dir")
    q.add_argument("key", nargs="?", help="SHA-1 key or a unique prefix of it")
    q.add_argument("--all", action="store_true", help="remove every snapshot in DIR")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _age(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def _no_dir(dir: Path) -> bool:
    """True (with the message every subcommand prints) when ``dir`` is not a directory."""
    if dir.is_dir():
        return False
    print(f"ds4mlx kv: {dir} is not a directory", file=sys.stderr)
    return True


def _resolve(dir: Path, key: str) -> Path | None:
    """The snapshot file whose key starts with ``key``; None (with a message) if none or
    ambiguous."""
    from ds4mlx.kv import store as kvs

    paths = kvs.match_keys(dir, key)
    if len(paths) == 1:
        return paths[0]
    msg = "no snapshot" if not paths else f"{len(paths)} snapshots"
    print(f"ds4mlx kv: {msg} matching {key!r} in {dir}", file=sys.stderr)
    return None


def _ls_scan(args: argparse.Namespace, dir: Path):
    """``(entries, bad)`` of ``dir``; with ``--verify`` every entry is read and checked."""
    from ds4mlx.kv import store as kvs

    scan = kvs.scan_dir(dir)
    bad = list(scan.bad)
    entries = []
    for e in scan.entries:
        if args.verify:
            try:
                kvs.load_file(e.path)
            except FileNotFoundError:
                continue
            except kvs.KVStoreError as exc:
                bad.append(kvs.BadFile(e.path, str(exc), e.size))
                continue
        entries.append(e)
    return entries, bad


def _ls_rows(entries, bad) -> list[tuple[dict[str, str], str, bool]]:
    """``(cells by column, free text, is bad)`` per file; ``full`` is the whole key."""
    now = time.time()
    rows = []
    for e in entries:
        cells = {
            "full": e.key,
            "key": e.key[:12],
            "tokens": str(e.tokens),
            "hits": str(e.hits),
            "age": _age(now - e.created),
            "used": _age(now - e.last_used),
            "reason": e.reason,
            "size": _size(e.size),
            "ctx": str(e.ctx_size),
            "model": e.model_identity + (f" q{e.expert_bits}" if e.expert_bits else ""),
        }
        rows.append((cells, e.head, False))
    for b in bad:
        name = b.path.name
        cells = {"full": name, "key": name[:12], "reason": "BAD", "size": _size(b.size)}
        rows.append((cells, b.reason, True))
    return rows


def _ls_table(title: str, cols: list[str], rows, width: int):
    """A rich table of ``rows`` that fits ``width`` cells: rich would shrink every column
    of a too-wide row (to "toke…"), so the free text is cut here and the least useful
    columns are dropped until the others fit whole."""
    from rich.table import Table
    from rich.text import Text

    widths = {c: max([len(c)] + [len(r[0].get(c, "")) for r in rows]) for c in cols}
    cols = list(cols)

    def need(names: list[str]) -> int:
        return sum(widths[c] for c in names) + 3 * (len(names) + 1) + 4

    for drop in ("model", "ctx", "used", "hits", "age"):
        if need(cols) + 12 <= width:
            break
        if drop in cols:
            cols.remove(drop)
    room = width - need(cols)
    t = Table(title=title, title_justify="left")
    for c in cols:
        t.add_column(
            c, justify="left" if c in ("key", "reason", "model") else "right", no_wrap=True
        )
    if room >= 12:
        t.add_column("text", no_wrap=True, overflow="ellipsis")
    for cells, text, is_bad in rows:
        style = "red" if is_bad else ""
        cells = {c: escape_controls(v) for c, v in cells.items()}  # from the files: untrusted
        cut = Text(escape_controls(text), style=style)
        cut.truncate(room, overflow="ellipsis")  # by terminal cells: CJK counts double
        t.add_row(
            *(
                Text(cells.get(c, ""), style=style + (" bold" if c == "reason" and is_bad else ""))
                for c in cols
            ),
            *([cut] if room >= 12 else []),
        )
    return t


def _cmd_ls(args: argparse.Namespace, con: Console) -> int:
    dir = Path(args.dir)
    if _no_dir(dir):
        return 2
    entries, bad = _ls_scan(args, dir)
    cols = ["key", "tokens", "hits", "age", "used", "reason", "size"]
    if args.long:
        cols += ["ctx", "model"]
    rows = _ls_rows(entries, bad)
    total = sum(e.size for e in entries) + sum(b.size for b in bad)
    summary = f"{len(entries)} snapshots, {len(bad)} bad, {_size(total)} total"
    if not con.is_terminal:  # a pipe or a file: whole values, tab-separated, for scripts
        print("\t".join([*cols, "text"]), file=con.file)
        for cells, text, _ in rows:
            vals = [cells["full"], *(cells.get(c, "") for c in cols[1:]), text]
            print("\t".join(" ".join(v.split()) for v in vals), file=con.file)
        print(summary, file=sys.stderr)
        return 0
    con.print(_ls_table(f"KV cache {dir}", cols, rows, con.width))
    con.print(summary)
    return 0


def _cmd_show(args: argparse.Namespace, con: Console) -> int:
    from rich.table import Table
    from rich.text import Text

    from ds4mlx.kv import store as kvs

    if _no_dir(Path(args.dir)):
        return 2
    path = _resolve(Path(args.dir), args.key)
    if path is None:
        return 1
    try:
        loaded = kvs.load_file(path)
    except (FileNotFoundError, kvs.KVStoreError) as exc:
        con.print(Text(f"{path.name}: BAD: {exc}", style="bold red"))
        return 1
    e = kvs.with_hits(loaded.entry)
    now = time.time()
    t = Table(show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()
    rows = [
        ("key", e.key),
        ("file", str(path)),
        ("size", f"{_size(e.size)} ({e.size} bytes)"),
        ("model", e.model_identity),
        ("expert bits", str(e.expert_bits) if e.expert_bits is not None else "-"),
        ("context", f"{e.ctx_size} tokens"),
        ("tokens", str(e.tokens)),
        ("text", f"{e.text_bytes} bytes, {len(loaded.text)} characters"),
        ("reason", e.reason),
        ("hits", str(e.hits)),
        ("created", f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e.created))} ({_age(now - e.created)} ago)"),
        ("last used", f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e.last_used))} ({_age(now - e.last_used)} ago)"),
        ("tool memory", f"{len(loaded.tool_memory)} ids"),
        ("arrays", f"{len(loaded.arrays)} ({_size(sum(a.nbytes for a in loaded.arrays.values()))})"),
        ("session meta", json.dumps(loaded.meta, ensure_ascii=False)),
    ]  # fmt: skip
    # Everything shown comes from the file, and its text from any client of the server
    # that wrote it: no control character reaches the terminal raw (a title set, the
    # screen cleared, a bidi override).
    for k, v in rows:
        t.add_row(k, Text(escape_controls(v)))
    con.print(t)
    head = loaded.text[: max(0, args.chars)]
    con.rule("text")
    con.print(Text(escape_controls(head)), soft_wrap=True)
    if len(loaded.text) > len(head):
        con.print(Text(f"… ({len(loaded.text) - len(head)} more characters)", style="dim"))
    return 0


def _cmd_rm(args: argparse.Namespace, con: Console) -> int:
    from ds4mlx.kv import store as kvs

    dir = Path(args.dir)
    if args.all == bool(args.key):
        why = "not both" if args.all else "see ds4mlx kv ls for the keys"
        print(f"ds4mlx kv rm: give a KEY or --all ({why})", file=sys.stderr)
        return 2
    if _no_dir(dir):
        return 2
    if args.all:
        n, parts = kvs.clear_dir(dir)
        also = f" and {parts} rank parts" if parts else ""
        con.print(f"removed {n} snapshots{also} from {dir}")
        return 0
    # A key's snapshot file and its pipeline ranks' parts go together; a rank > 0's
    # directory may hold only parts.
    keys = kvs.files_of_keys(dir, args.key)
    if len(keys) != 1:
        msg = "no snapshot" if not keys else f"{len(keys)} snapshots"
        print(f"ds4mlx kv: {msg} matching {args.key!r} in {dir}", file=sys.stderr)
        return 1
    (paths,) = keys.values()
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            print(f"ds4mlx kv: {path} vanished", file=sys.stderr)
            return 1
        con.print(f"removed {path.name}")
    return 0


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    """Run ``ds4mlx kv`` for parsed ``args``; returns the exit status.

    ``ls`` lists bad files in red (exit 0); ``show``/``rm`` exit 1 when the key matches
    no single snapshot or the file is bad; 2 on usage errors and (every subcommand)
    when the directory does not exist.
    """
    from rich.console import Console

    con = console or Console()
    cmd = {"ls": _cmd_ls, "show": _cmd_show, "rm": _cmd_rm}[args.kv_command]
    return cmd(args, con)
