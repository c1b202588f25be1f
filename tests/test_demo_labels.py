"""Issue 26 item 5: what the demo serves is said the same way everywhere. The one source
of truth is ``ds4mlx.model.demo.demo_policy``: on ``--demo`` (no output limit) nothing
thinks. The banner, ``GET /v1/models``, the docs and the agent's ``/think`` and status
line must all agree (real server, real agent in a terminal)."""

from __future__ import annotations

import os
import sys

import pexpect
import pytest
from server_util import DEMO_ENV, HTTP, REPO, Server


@pytest.mark.slow
def test_demo_labels_agree_everywhere(tmp_path):
    env = {
        **DEMO_ENV,
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
        "PYTHONPATH": str(REPO),
        "COLUMNS": "200",
    }
    # 1. The server: banner and /v1/models.
    with Server(None, extra=["--demo"], env=env, scripted=False) as srv:
        models = HTTP.get(srv.url + "/v1/models").json()["data"]
        banner = " ".join(srv.log_path.read_text().split())
    ids = [m["id"] for m in models]
    assert {"deepseek-v4-flash", "deepseek-chat", "deepseek-reasoner"} <= set(ids)
    assert all(m["thinking"] is False for m in models), models
    for i in ids:
        assert f"{i} (non-thinking)" in banner, banner
    assert "(thinking)" not in banner and "without thinking" in banner

    # 2. The docs.
    readme = " ".join((REPO / "README.md").read_text().split())
    examples = " ".join((REPO / "examples" / "README.md").read_text().split())
    assert "on `--demo` every id runs without thinking" in examples
    assert "runs **without thinking**" in examples and "run without thinking" in readme

    # 3. The agent: /think is refused on the demo, the status line says no thinking.
    ws = tmp_path / "ws"
    ws.mkdir()
    child = pexpect.spawn(
        sys.executable,
        ["-m", "ds4mlx.cli", "agent", "--demo", "--ctx", "4096", "--workspace", str(ws)],
        env={**os.environ, **env},
        encoding="utf-8",
        timeout=300,
        dimensions=(40, 200),
    )
    try:
        child.expect("› ")
        child.sendline("/think")
        child.expect("thinking stays off: the demo model answers without thinking")
        child.expect("› ")
        child.sendline("hello")
        child.expect(r"ctx \d+/4096[^\n]*no thinking")
        child.expect("› ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
