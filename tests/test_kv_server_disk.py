"""Issue 5, must-hold 4, 5 and 7: the disk KV cache through a real server.

One ``ds4mlx serve`` process with ``--kv-disk-dir`` for the module (restarted once,
on the same directory, for the restart test); plan decisions come from ``--trace``.
"""

from __future__ import annotations

import json

import pytest
from kv_server_util import (
    EOS,
    Trace,
    anthropic_usage,
    chat_usage,
    invoke,
    long_system,
    post,
    script,
    tool_calls,
)
from server_util import Server

from ds4mlx.kv.store import scan_dir

SETTINGS = [
    "--sessions",
    "1",  # _unrelated evicts the one live state
    "--kv-cache-min-tokens",
    "256",
    "--kv-cache-boundary-align-tokens",
    "256",
    "--kv-cache-continued-interval-tokens",
    "8192",
]
TOOL = {
    "name": "sum",
    "description": "Add numbers",
    "input_schema": {
        "type": "object",
        "properties": {"label": {"type": "string"}, "values": {"type": "array"}},
        "required": ["values"],
    },
}


class DiskServer:
    """A server on a fixed ``--kv-disk-dir`` that can be restarted on it."""

    def __init__(self, model_dir, root):
        self.model_dir = model_dir
        self.dir = root / "kv"
        self.root = root
        self.n = 0
        self.server = None

    def start(self) -> Server:
        self.n += 1
        trace = self.root / f"trace{self.n}.jsonl"
        s = Server(
            self.model_dir,
            ctx=8192,
            extra=["--kv-disk-dir", str(self.dir), "--trace", str(trace), *SETTINGS],
        )
        s.trace = Trace(trace)
        self.server = s.start()
        return self.server

    def stop(self) -> None:
        rc = self.server.stop()
        assert rc == 0, self.server.log()[-3000:]


@pytest.fixture(scope="module")
def disk(tiny_model_dir, tmp_path_factory):
    d = DiskServer(tiny_model_dir, tmp_path_factory.mktemp("disk"))
    d.start()
    try:
        yield d
    finally:
        if d.server.proc.poll() is None:
            d.stop()


def _unrelated(server, seed: int) -> None:
    """A different conversation, long enough to be worth an evict save itself."""
    script(server, "x" + EOS)
    post(
        server,
        "/v1/chat/completions",
        {
            "model": "deepseek-chat",
            "messages": [
                {"role": "system", "content": long_system(40, seed=seed)},
                {"role": "user", "content": f"unrelated {seed}"},
            ],
        },
    )


def test_restart_resumes_from_disk_with_exact_dsml_replay(disk):
    """A tool turn whose sampled DSML differs from the canonical rendering of the
    client's JSON; after an unrelated request, a clean stop and a restart on the same
    directory, the continuation loads from disk (exact DSML replay must work for the
    prefix to match), prefills only the new suffix and gives the same greedy output."""
    server = disk.server
    system = long_system(60, seed=1)
    # "[1,2]" sampled; the client gets [1, 2] back and canonical DSML would say "[1, 2]".
    call = invoke("sum", ("values", [1, 2], "[1,2]"), ("label", "tot", None))
    user = [{"role": "user", "content": "add them"}]
    body = {
        "model": "deepseek-chat",
        "max_tokens": 10,
        "system": system,
        "tools": [TOOL],
        "messages": user,
        "temperature": 0,
    }
    script(server, "Adding." + tool_calls(call))
    r1 = post(server, "/v1/messages", {**body, "max_tokens": 200})
    p1, _ = anthropic_usage(r1)
    live1 = p1 + r1["usage"]["output_tokens"] - 1
    (use,) = [b for b in r1["content"] if b["type"] == "tool_use"]
    assert use["input"] == {"values": [1, 2], "label": "tot"}  # schema order
    _unrelated(server, 7)  # evict-saves the tool turn
    follow = user + [
        {"role": "assistant", "content": r1["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "3"}],
        },
    ]
    body2 = {**body, "messages": follow}
    r2 = post(server, "/v1/messages", body2)  # greedy: temperature 0, no script
    plan = server.trace.last()
    assert plan["decision"] == "disk", plan
    p2, c2 = anthropic_usage(r2)
    assert c2 == live1

    disk.stop()
    entries = scan_dir(disk.dir).entries
    assert {"cold", "evict", "shutdown"} <= {e.reason for e in entries}
    server = disk.start()
    r3 = post(server, "/v1/messages", body2)
    plan = server.trace.last()
    assert plan["decision"] == "disk", plan
    # body2 was not a live continuation: its end was saved (``prompt``) before it
    # generated, so the replay after the restart resumes with the whole prompt cached.
    assert anthropic_usage(r3) == (p2, p2)
    assert r3["content"] == r2["content"]  # same greedy output as before the restart

    # Without exact replay the canonical "[1, 2]" breaks the prefix: no such disk hit.
    bad = {
        **body2,
        "messages": [
            *user,
            {"role": "assistant", "content": [{**use, "id": "toolu_other"}]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_other", "content": "3"}],
            },
        ],
    }
    r4 = post(server, "/v1/messages", bad)
    assert anthropic_usage(r4)[1] < live1


def _evicted(server, name: str, seed: int) -> tuple[list[dict], dict, int]:
    """Conversation ``name`` served (scripted reply), then replaced by an unrelated one,
    which evict-saves it whole: ``(its messages, the reply, its live tokens)``."""
    conv = [
        {"role": "system", "content": long_system(50, seed=seed)},
        {"role": "user", "content": f"conversation {name}"},
    ]
    script(server, f"Reply {name}." + EOS)
    r = post(server, "/v1/chat/completions", {"model": "deepseek-chat", "messages": conv})
    prompt, _ = chat_usage(r)
    _unrelated(server, seed + 1)
    return conv, r, prompt + r["usage"]["completion_tokens"] - 1


def _back_to(server, conv: list[dict], reply: dict, name: str) -> dict:
    """The next turn of conversation ``name`` (after ``reply``), asserted to be served
    from disk; returns the response."""
    follow = conv + [
        {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
        {"role": "user", "content": f"back to {name}"},
    ]
    script(server, f"Again {name}." + EOS)
    r = post(server, "/v1/chat/completions", {"model": "deepseek-chat", "messages": follow})
    plan = server.trace.last()
    assert plan["decision"] == "disk", plan
    return r


def _written(server) -> int:
    """Snapshots the server's writer took so far (written or still queued)."""
    w = server.wait_idle()["kv_writer"]
    return w["written"] + w["pending"] + int(w["writing"])


@pytest.mark.slow
def test_scored_prompts_are_never_saved(disk):
    """A scored prompt (completions ``echo`` with ``logprobs``: always prefilled whole,
    so no lookup restores one) takes no disk snapshot: none at its checkpoints, and no
    ``evict`` save when the next one replaces it (lm-eval sends thousands). The
    conversation that replaces one is saved as usual."""
    server = disk.server

    def scored(seed: int) -> None:
        text = f"Scored passage {seed}. " + long_system(40, seed=seed)
        body = {"model": "m", "prompt": text, "max_tokens": 1}
        post(server, "/v1/completions", {**body, "echo": True, "logprobs": 1})

    scored(901)  # evict-saves the conversation it replaces, as any cold prompt does
    before = _written(server)
    scored(901)
    scored(902)
    assert _written(server) == before
    assert [p["decision"] for p in server.trace.plans()[-3:]] == ["cold"] * 3
    _unrelated(server, 77)  # replaces the scored state: no evict save of it
    assert _written(server) > before  # the conversation's own checkpoints are saved
    heads = [e.head for e in scan_dir(disk.dir).entries]
    assert not [h for h in heads if "Scored passage" in h], heads


def test_switching_conversations_a_b_a_hits_disk(disk):
    server = disk.server
    conv_a, ra, live_a = _evicted(server, "A", 11)  # B replaces A: A is saved (evict)
    assert server.trace.last()["decision"] in ("cold", "disk")
    assert chat_usage(_back_to(server, conv_a, ra, "A"))[1] == live_a


def test_billing_header_does_not_split_the_cache(disk):
    """Two Claude Code sessions differing only in the billing-header line share the
    cached system prefix (the line is stripped before rendering)."""
    server = disk.server
    system_text = long_system(70, seed=21)

    def session(billing: str, question: str) -> dict:
        script(server, "Sure." + EOS)
        body = {
            "model": "deepseek-chat",
            "max_tokens": 20,
            "system": [
                {
                    "type": "text",
                    "text": f"x-anthropic-billing-header: cc_version=2.1.{billing}; cc_entrypoint=cli;",
                },
                {"type": "text", "text": system_text, "cache_control": {"type": "ephemeral"}},
            ],
            "messages": [{"role": "user", "content": question}],
        }
        return post(server, "/v1/messages", body)

    r1 = session("100.a1b", "first session")
    p1, c1 = anthropic_usage(r1)
    r2 = session("200.c3d", "second session")
    plan = server.trace.last()
    assert plan["decision"] == "disk", plan
    p2, c2 = anthropic_usage(r2)
    # The shared prefix is everything before the user turn: BOS + system text.
    assert c2 >= p1 - 10 and p2 - c2 <= 10


def test_a_snapshot_the_session_refuses_falls_back_to_a_shorter_one(disk):
    """A snapshot that loads (its digest holds: the digest covers tensors, not the
    header) but whose state the session refuses, here another model's identity in its
    session meta, is marked bad; the lookup runs again and a shorter valid snapshot of
    the same conversation serves. It used to send the request cold."""
    import mlx.core as mx

    server = disk.server
    conv, r, live = _evicted(server, "F", 41)  # F saved whole, beside its shorter cold save
    entries = scan_dir(disk.dir).entries
    (whole,) = [e for e in entries if e.reason == "evict" and e.tokens == live]
    shorter = [e for e in entries if e.reason == "cold" and "conversation F" not in e.head]
    t, m = mx.load(str(whole.path), format="safetensors", return_metadata=True)
    mx.eval(list(t.values()))
    meta = json.loads(m["session_meta"])
    m["session_meta"] = json.dumps({**meta, "identity": "another-model"}, sort_keys=True)
    with open(whole.path, "wb") as f:
        mx.save_safetensors(f, t, m)
    cached = chat_usage(_back_to(server, conv, r, "F"))[1]
    assert 0 < cached < live and shorter, (cached, live, [e.tokens for e in entries])
    assert "cannot restore" in server.log()
