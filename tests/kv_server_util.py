"""Helpers for the live-continuation and disk-cache server tests (issue 5).

Builds on ``server_util`` (a real ``ds4mlx serve`` subprocess with the tiny float32
model and scripted decoding). Each job's plan decision comes from the server's
``--trace`` file, one ``"plan"`` record per job.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from server_util import HTTP

EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
DSML = "｜DSML｜"

# A long, varied system prompt: ~9 tokens per sentence with the DeepSeek tokenizer.
_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
    "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def long_system(n_sentences: int, seed: int = 0) -> str:
    """A deterministic system prompt of ``n_sentences`` short numbered sentences."""
    out = []
    for i in range(n_sentences):
        w = [_WORDS[(i * 7 + k * 3 + seed) % len(_WORDS)] for k in range(5)]
        out.append(f"Rule {i}: {' '.join(w)}.")
    return " ".join(out)


def invoke(name: str, *params: tuple[str, object, str | None]) -> str:
    """One DSML invoke block. ``params``: ``(name, value, raw)``; a str value is written
    raw (``string="true"``); other values as JSON, or as ``raw`` text when given (to
    sample a spelling that differs from the canonical JSON)."""
    lines = [f'<{DSML}invoke name="{name}">']
    for pname, value, raw in params:
        if isinstance(value, str) and raw is None:
            lines.append(f'<{DSML}parameter name="{pname}" string="true">{value}</{DSML}parameter>')
        else:
            text = raw if raw is not None else json.dumps(value, ensure_ascii=False)
            lines.append(f'<{DSML}parameter name="{pname}" string="false">{text}</{DSML}parameter>')
    lines.append(f"</{DSML}invoke>")
    return "\n".join(lines)


def tool_calls(*invokes: str, eos: bool = True) -> str:
    """The DSML tool_calls block for ``invokes`` (with the ``\\n\\n`` separator) + EOS."""
    body = "\n".join(invokes)
    return f"\n\n<{DSML}tool_calls>\n{body}\n</{DSML}tool_calls>" + (EOS if eos else "")


def script(server, *texts: str, greedy: bool = False, tokens=None) -> None:
    """Queue scripted continuations (texts, then token-id lists) on ``server``."""
    body = {"texts": list(texts), "greedy": greedy}
    if tokens:
        body["tokens"] = [list(t) for t in tokens]
    r = HTTP.post(server.url + "/debug/script", json=body, timeout=10)
    r.raise_for_status()


def count_tokens(server, text: str) -> int:
    """Tokens of ``text`` tokenized on its own (special tokens recognized)."""
    r = HTTP.post(server.url + "/v1/tokenize", json={"text": text}, timeout=30)
    r.raise_for_status()
    return r.json()["count"]


def tokenize(server, text: str) -> list[int]:
    r = HTTP.post(server.url + "/v1/tokenize", json={"text": text}, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


class Trace:
    """Reads the ``plan`` records a server writes to its ``--trace`` file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._seen = 0

    def _records(self):
        """Every complete JSON record of the trace file, in order."""
        if not self.path.exists():
            return
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                yield json.loads(line)
            except ValueError:
                continue  # a line the server is still writing

    def plans(self) -> list[dict]:
        return [rec for rec in self._records() if rec.get("kind") == "plan"]

    def jobs(self) -> list[dict]:
        """One record per planned job, in order: its ``plan`` fields plus the ``path`` of
        its ``prompt`` record (the endpoint; ``ws /v1/responses`` for the WebSocket)."""
        paths: dict[int, str] = {}
        out = []
        for rec in self._records():
            if rec.get("kind") == "prompt":
                paths[rec["job"]] = rec.get("path")
            elif rec.get("kind") == "plan":
                out.append({**rec, "path": paths.get(rec["job"])})
        return out

    def prompts(self) -> list[dict]:
        """The ``prompt`` records (``job``, ``path``, ``text``, ``tokens``), in order."""
        return [rec for rec in self._records() if rec.get("kind") == "prompt"]

    def last(self, timeout: float = 5.0) -> dict:
        """The newest plan record (waits briefly for the server to flush it)."""
        deadline = time.monotonic() + timeout
        while True:
            p = self.plans()
            if p:
                return p[-1]
            if time.monotonic() > deadline:
                raise AssertionError("no plan record in the trace")
            time.sleep(0.05)


def post(server, path: str, body: dict, *, status: int = 200, timeout: float = 300) -> dict:
    """POST JSON and return the decoded answer, asserting the HTTP status."""
    r = HTTP.post(server.url + path, json=body, timeout=timeout)
    assert r.status_code == status, (r.status_code, r.text[:2000])
    return r.json()


def anthropic_usage(resp: dict) -> tuple[int, int]:
    """``(prompt tokens, cached tokens)`` of an Anthropic Messages answer."""
    u = resp["usage"]
    return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]


def chat_usage(resp: dict) -> tuple[int, int]:
    u = resp["usage"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def responses_usage(resp: dict) -> tuple[int, int]:
    u = resp["usage"]
    return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]


@contextlib.contextmanager
def traced_server(model_dir, tmp_path_factory, *, ctx: int = 8192, extra=()):
    """A ``ds4mlx serve`` (scripted decoding) with a ``--trace`` file read by ``s.trace``."""
    from server_util import Server

    trace = tmp_path_factory.mktemp("traced") / "trace.jsonl"
    with Server(model_dir, ctx=ctx, extra=["--trace", str(trace), *extra]) as s:
        s.trace = Trace(trace)
        yield s


# A one-parameter Anthropic tool for prompt-cache tests.
LOOKUP_TOOL = {
    "name": "lookup",
    "description": "Look a word up",
    "input_schema": {
        "type": "object",
        "properties": {"word": {"type": "string"}},
        "required": ["word"],
    },
}
