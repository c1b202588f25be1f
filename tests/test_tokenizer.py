"""Tokenizer: DeepSeek V4 special tokens, round trips, UTF-8-safe streaming."""

from __future__ import annotations

import shutil

import pytest

from ds4mlx.tokenizer import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    LATEST_REMINDER,
    SPECIAL_TOKENS,
    THINK,
    THINK_END,
    USER,
    Tokenizer,
    TokenizerError,
    package_tokenizer_path,
)

TEXTS = [
    "Hello, world! The quick brown fox jumps over 1234567 lazy dogs.",
    "中文分词测试：你好，世界。深度求索的模型。",
    "日本語のテキスト、カタカナとひらがな。한국어도 있습니다.",
    "emoji 🤖🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 and ZWJ‍s",
    "mixed: naïve café Ωμέγα ∑∫√ — “quotes” … \u00a0nbsp\ttab\n\nnewlines  spaces   ",
    f"{BOS}{USER}解释 🤖 please{ASSISTANT}{THINK}思考…{THINK_END}答案"
    f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="read">\n</{DSML}tool_calls>{EOS}',
    f"{LATEST_REMINDER}remember 😀{EOS}{USER}",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(None)


def test_special_token_ids(tok):
    assert tok.encode(BOS) == [0] and tok.bos_id == 0
    assert tok.encode(EOS) == [1] and tok.eos_id == 1
    assert tok.encode(THINK) == [128821] and tok.think_id == 128821
    assert tok.encode(THINK_END) == [128822] and tok.think_end_id == 128822
    assert tok.encode(DSML) == [128825] and tok.dsml_id == 128825
    assert tok.encode(USER) == [tok.user_id]
    assert tok.encode(ASSISTANT) == [tok.assistant_id]
    assert tok.encode(LATEST_REMINDER) == [tok.latest_reminder_id]
    assert tok.vocab_size == 129280
    for s in SPECIAL_TOKENS:
        (i,) = tok.encode(s)
        assert tok.decode([i]) == s
        assert tok.token_to_id(s) == i


def test_no_bos_added(tok):
    ids = tok.encode("hi")
    assert ids and ids[0] != tok.bos_id


def test_special_tokens_inside_text(tok):
    ids = tok.encode(f"a{USER}b{THINK}c{DSML}d")
    for s in (USER, THINK, DSML):
        assert tok.token_to_id(s) in ids


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_never_splits_utf8(tok, text):
    ids = tok.encode(text)
    det = tok.detokenizer()
    pieces = [det.add(i) for i in ids]
    pieces.append(det.flush())
    for p in pieces:
        assert "\ufffd" not in p
        # Complete characters only: each piece survives a UTF-8 round trip on its own.
        assert p.encode("utf-8").decode("utf-8") == p
    assert "".join(pieces) == tok.decode(ids) == text


def test_streaming_holds_back_partial_char(tok):
    # 🤖 is two byte-level tokens in this vocabulary: the first one emits nothing.
    ids = tok.encode("🤖")
    assert len(ids) >= 2
    det = tok.detokenizer()
    assert det.add(ids[0]) == ""
    assert det.pending
    out = "".join(det.add(i) for i in ids[1:])
    assert out == "🤖" and not det.pending


def test_streaming_flush_of_truncated_char(tok):
    ids = tok.encode("🤖")
    det = tok.detokenizer()
    det.add(ids[0])
    assert det.flush() == tok.decode(ids[:1])  # replacement char, like decode()


def test_model_dir_tokenizer_preferred(tmp_path):
    shutil.copy(package_tokenizer_path(), tmp_path / "tokenizer.json")
    t = Tokenizer.load(tmp_path)
    assert t.path == tmp_path / "tokenizer.json"
    # A directory without one falls back to the package file.
    assert Tokenizer.load(tmp_path / "missing").path == package_tokenizer_path()


def test_foreign_tokenizer_rejected(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError):
        Tokenizer.load(tmp_path)


def test_special_token_spellings_are_found_leftmost_longest(tok):
    """The trie pattern finds what a flat longest-first alternation finds (the library's
    leftmost-longest match of added tokens), words that are prefixes of others included."""
    import random
    import re

    from ds4mlx.tokenizer import _literals_re

    def flat(words):
        return re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)))

    toy = ["<a>", "<ab>", "<a", "<abc|>", "b", "<｜x｜>"]
    real = list(tok._added_ids)
    rng = random.Random(0)
    for words, extra in ((toy, ["<", "a", "|", "c"]), (real, ["<", "｜", "▁", "x", "/"])):
        trie, ref = _literals_re(words), flat(words)
        pieces = words + extra
        for _ in range(2000):
            s = "".join(rng.choice(pieces) for _ in range(12))
            assert [m.span() for m in trie.finditer(s)] == [m.span() for m in ref.finditer(s)], s


def _random_text(rng, n: int) -> str:
    """``n`` pieces of text drawn to hit every pre-tokenizer rule: words, digits, CJK,
    punctuation, runs of spaces and newlines, tabs, no-break spaces, emoji, markers."""
    pieces = [
        *"abcXYZ 019.,;:!?()[]{}<>-_=+*/\\\"'\n\r\t\u00a0\u3000éü😀",
        *TEXTS,
        "  ", "\n\n", " \n ", "123", "def ", "->", "'s", " '", "中文", "カタカナ", USER, THINK,
    ]  # fmt: skip
    return "".join(rng.choice(pieces) for _ in range(n))


def test_split_points_are_pre_tokenizer_boundaries(tok):
    """Cutting at `split_points` changes no token: the pieces' counts add up to the whole
    text's (so `Tokenizer.count` is exact), on texts that exercise every splitting rule."""
    import random

    from ds4mlx.tokenizer import split_points

    rng = random.Random(0)
    whole = lambda s: len(tok._tok.encode(s, add_special_tokens=False).ids)  # noqa: E731
    for _ in range(300):
        text = _random_text(rng, rng.randint(1, 400))
        cuts = split_points(text, 64)
        assert cuts == sorted(set(cuts)) and all(0 < c < len(text) for c in cuts)
        bounds = [0, *cuts, len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        assert sum(whole(p) for p in pieces) == whole(text), (text, cuts)
    # A stretch with no such place is not cut; pieces are at least half the size asked.
    assert split_points("x" * 1000, 64) == []
    cuts = split_points("ab " * 500, 64)
    assert cuts and all(b - a >= 32 for a, b in zip([0, *cuts], cuts, strict=False))


def test_count_stops_past_the_limit_and_encode_frees_the_gil(tok):
    """`Tokenizer.count` is the token count (special spellings as their ids), or, given a
    limit, stops soon after passing it; a long `encode` releases the GIL (another thread
    runs meanwhile) and gives the same ids as the library's own single-text call."""
    import random
    import threading

    rng = random.Random(1)
    text = "\n".join(_random_text(rng, 40) for _ in range(1500))
    ids = tok._tok.encode(text, add_special_tokens=False).ids
    assert tok.count(text) == len(ids)
    limit = len(ids) // 20
    n = tok.count(text, limit)
    assert limit < n < len(ids) // 2, (limit, n, len(ids))
    big = text + "\n" + text
    want = tok._tok.encode(big, add_special_tokens=False).ids
    ticks, stop = [0], threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks[0] += 1
            stop.wait(0.001)

    t = threading.Thread(target=tick)
    t.start()
    try:
        got = tok.encode(big)
    finally:
        stop.set()
        t.join()
    assert got == want
    assert ticks[0] > 10, ticks  # held for the whole call, the thread could not tick


def test_a_process_parses_each_tokenizer_file_version_once(tmp_path):
    # Every Engine.load asks for the tokenizer; parsing it costs ~0.35 CPU-s each time.
    shutil.copyfile(package_tokenizer_path(), tmp_path / "tokenizer.json")
    first = Tokenizer.load(tmp_path)
    assert Tokenizer.load(tmp_path) is first
    assert Tokenizer.load(None) is Tokenizer.load(None) is not first  # another file
    # A replaced file is parsed anew (a new inode; mtime and size may not move).
    shutil.copyfile(package_tokenizer_path(), tmp_path / "new.json")
    (tmp_path / "new.json").replace(tmp_path / "tokenizer.json")
    assert Tokenizer.load(tmp_path) is not first


def test_a_missing_model_tokenizer_falls_back_to_the_package_one(tmp_path):
    assert Tokenizer.load(tmp_path).path == package_tokenizer_path()
