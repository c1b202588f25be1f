"""``serve --demo``'s output cap ends a turn like an EOS would, so the next turn continues
from the whole sampled turn (hardening issue, item 6: the cap's last token used to be
emitted but not fed, binding a live state one token short of what the client saw)."""

from __future__ import annotations

import shutil

from kv_server_util import Trace, post, script
from server_util import DEMO_CAP as CAP
from server_util import DEMO_ENV, Server


def test_demo_cap_binds_the_whole_turn(tiny_model_dir, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(tiny_model_dir, cache / "ds4mlx" / "demo")
    trace = tmp_path / "trace.jsonl"
    extra = ["--demo", "--trace", str(trace)]
    with Server(None, extra=extra, env={**DEMO_ENV, "XDG_CACHE_HOME": str(cache)}) as s:
        t = Trace(trace)
        first = [{"role": "user", "content": "hi"}]
        script(s, "Hello there my good friend, how are you today? " * 40)
        r1 = post(s, "/v1/chat/completions", {"model": "deepseek-v4-flash", "messages": first})
        assert r1["choices"][0]["finish_reason"] == "stop"
        u1 = r1["usage"]
        assert u1["completion_tokens"] == CAP
        text = r1["choices"][0]["message"]["content"]
        script(s, "ok")
        nxt = [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        post(s, "/v1/chat/completions", {"model": "deepseek-v4-flash", "messages": nxt})
        plan = t.last()
        # The demo runs without thinking: the live state is a prefix of the next prompt,
        # and it holds every capped token the client saw.
        assert plan["decision"] in ("exact-token-prefix", "text-prefix"), plan
        assert plan["cached"] == u1["prompt_tokens"] + CAP
