"""``serve --demo``'s output cap ends a turn like an EOS would, so the next turn continues
from the whole sampled turn (hardening issue, item 6: the cap's last token used to be
emitted but not fed, binding a live state one token short of what the client saw)."""

from __future__ import annotations

import shutil

from kv_server_util import Trace, post, script
from server_util import Server, tiny_model_dir  # noqa: F401

CAP = 6


def test_demo_cap_binds_the_whole_turn(tiny_model_dir, tmp_path):  # noqa: F811
    cache = tmp_path / "cache"
    shutil.copytree(tiny_model_dir, cache / "ds4mlx" / "demo")
    trace = tmp_path / "trace.jsonl"
    extra = ["--demo", "--tokens", str(CAP), "--trace", str(trace)]
    with Server(None, extra=extra, env={"XDG_CACHE_HOME": str(cache)}) as s:
        t = Trace(trace)
        first = [{"role": "user", "content": "hi"}]
        script(s, "</think>Hello there my good friend, how are you today?")
        r1 = post(s, "/v1/chat/completions", {"model": "deepseek-v4-flash", "messages": first})
        assert r1["choices"][0]["finish_reason"] == "stop"
        u1 = r1["usage"]
        assert u1["completion_tokens"] == CAP
        text = r1["choices"][0]["message"]["content"]
        script(s, "</think>ok")
        nxt = [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        post(s, "/v1/chat/completions", {"model": "deepseek-v4-flash", "messages": nxt})
        plan = t.last()
        # The visible key selects the state holding every capped token, thinking included.
        assert plan["decision"] == "live-thinking"
        assert plan["cached"] == u1["prompt_tokens"] + CAP
