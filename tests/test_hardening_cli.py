"""Issue 13 item 14: the first minutes of a new user (real ``ds4mlx`` processes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
from server_util import HTTP, Server

CMD = [sys.executable, "-m", "ds4mlx.cli"]


def _run(*args, env=None, timeout=120):
    return subprocess.run(
        [*CMD, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_version_and_help_texts():
    r = _run("--version")
    assert r.returncode == 0 and r.stdout.startswith("ds4mlx ") and r.stdout.split()[1][0].isdigit()
    for sub in ([], ["serve"], ["agent"], ["generate"], ["bench"], ["kv"], ["tokenize"]):
        h = _run(*sub, "--help")
        assert h.returncode == 0, h.stderr
        assert "`" not in h.stdout, (sub, h.stdout)
    agent = _run("agent", "--help").stdout
    for cmd in ("/help", "/new", "/list", "/switch N", "/save", "/history", "/think", "/quit"):
        assert cmd in agent, agent


def test_busy_port_is_found_before_the_model_loads(tmp_path):
    """The port is checked first: a model directory that does not exist is never read."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run("serve", "-m", tmp_path / "no-such-model", "--port", port)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert f"127.0.0.1:{port}" in r.stderr and "--port" in r.stderr, r.stderr
    assert "cannot load" not in r.stderr  # the model was never read: no wall-time bound


def test_banner_suggests_openblas_and_rejected_requests_are_logged(tiny_model_dir):
    env = {"DS4MLX_NO_OPENBLAS": "1", "LD_PRELOAD": ""}
    with Server(tiny_model_dir, ctx=1024, extra=["--api-key", "k"], env=env) as srv:
        auth = {"Authorization": "Bearer k"}
        assert HTTP.post(srv.url + "/v1/chat/completions", json={}).status_code == 401
        r = HTTP.post(srv.url + "/v1/chat/completions", json={"messages": 5}, headers=auth)
        assert r.status_code == 400
        assert HTTP.get(srv.url + "/v1/nothing", headers=auth).status_code == 404
        # The base URL answers (Claude Code probes it with HEAD at start), without a key.
        assert httpx.head(srv.url + "/").status_code == 200
        assert HTTP.get(srv.url + "/").json()["service"] == "ds4mlx"
        big = b"x" * (33 * 1024 * 1024)
        r = HTTP.post(srv.url + "/v1/messages", content=big, headers=auth, timeout=60)
        assert r.status_code == 413
        time.sleep(0.3)
        log = srv.log()
    assert "OpenBLAS" in log and "BLAS reference" in log, log[:2000]
    rejected = [ln for ln in log.splitlines() if " rejected " in ln]
    for status, path in (
        (401, "/v1/chat/completions"),
        (400, "/v1/chat/completions"),
        (404, "/v1/nothing"),
        (413, "/v1/messages"),
    ):
        assert any(f"{path} rejected {status}" in ln for ln in rejected), (status, rejected)
    assert not any(" / rejected" in ln for ln in rejected), rejected
