"""Serving under two MLX ring ranks on 127.0.0.1 (pipeline and tensor modes): the live
tool loop, per-rank shutdown snapshots, a killed or stopped rank, the rank timeout,
idle followers. Split from ``test_distributed.py`` so the two files run on two pytest
workers (each rank pair mostly waits).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from tests.dist_util import kill_group, under_launcher


def _ranks_of(launcher_pid: int) -> list[int]:
    """Pids of the ``ds4mlx.cli`` processes started under the launcher's session."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != launcher_pid:
                continue
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ProcessLookupError):
            continue
        if b"ds4mlx.cli" in cmdline and b"mlx.launch" not in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_pipeline_serve_continues_a_tool_loop_live_and_ranks_die_with_the_launcher(
    tiny_f32_dir, tmp_path, mode
):
    """``serve --distributed pipeline`` (or ``tensor``) on two ranks: the Anthropic loop
    with two parallel calls continues live (only the tool-results suffix is prefilled),
    and SIGTERM to the launcher (which does not stop its ranks itself) leaves no rank
    running."""
    import time

    import httpx
    from server_util import Server

    server = under_launcher(Server(tiny_f32_dir, ctx=4096, extra=["--distributed", mode]))
    proc = None
    try:
        server.start(timeout=300)
        proc = server.proc
        # /health and the banner say how the model is split.
        split = server.health()["distributed"]
        want = {"mode": mode, "ranks": 2}
        assert split == (want | {"layers": ["0-2", "2-4"]} if mode == "pipeline" else want)
        # The banner comes through the launcher, which re-prints rank 0's stdout with its
        # own buffering: it may show after /health answers.
        deadline = time.monotonic() + 60
        while f"{mode} over 2 ranks" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert f"{mode} over 2 ranks" in server.log(), server.log()[-3000:]
        server.script(
            "Both at once.</think>\n\n<｜DSML｜tool_calls>\n"
            '<｜DSML｜invoke name="read">\n'
            '<｜DSML｜parameter name="path" string="true">a.txt</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n"
            '<｜DSML｜invoke name="grep">\n'
            '<｜DSML｜parameter name="pattern" string="true">foo</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        )
        tools = [
            {"name": n, "input_schema": {"type": "object", "properties": {p: {"type": "string"}}}}
            for n, p in (("read", "path"), ("grep", "pattern"))
        ]
        body = {
            "model": "m",
            "max_tokens": 2000,
            "tools": tools,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "read a.txt and grep foo"}],
        }
        r1 = httpx.post(server.url + "/v1/messages", json=body, timeout=120).json()
        uses = [b for b in r1["content"] if b["type"] == "tool_use"]
        assert [u["name"] for u in uses] == ["read", "grep"], r1
        results = [
            {"type": "tool_result", "tool_use_id": u["id"], "content": f"R{i}"}
            for i, u in enumerate(uses)
        ]
        body["messages"] += [
            {"role": "assistant", "content": r1["content"]},
            {"role": "user", "content": results},
        ]
        body["max_tokens"] = 8
        body["thinking"] = {"type": "enabled"}  # a budget must be below max_tokens
        r2 = httpx.post(server.url + "/v1/messages", json=body, timeout=120).json()
        line = server.request_line(1)
        assert "live-anthropic" in line, line
        u1, u2 = r1["usage"], r2["usage"]
        cached = u2["cache_read_input_tokens"]
        assert cached == u1["input_tokens"] + u1["output_tokens"] - 1
        ranks = _ranks_of(proc.pid)
        assert len(ranks) == 2, ranks
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in ranks):
            time.sleep(0.2)
        assert not [p for p in ranks if _alive(p)], server.log()[-3000:]
    finally:
        kill_group(proc)
        server.kill()


TOOL_SCRIPT = (
    "Both at once.</think>\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="read">\n'
    '<｜DSML｜parameter name="path" string="true">a.txt</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
)


def _pipeline_server(model_dir, kv: Path, ranks: int = 2, mode: str = "pipeline"):
    """A started ``serve`` on the tiny checkpoint with ``kv`` as its disk KV directory:
    two ranks of ``--distributed mode`` under the launcher (own session), or one plain
    process."""
    from server_util import Server

    extra = ["--kv-cache-min-tokens", "16"]
    if ranks == 2:
        extra += ["--distributed", mode]
    server = Server(model_dir, ctx=4096, extra=extra, kv_dir=kv)
    if ranks == 2:
        under_launcher(server)
    return server.start(timeout=300)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_an_idle_follower_does_not_spin(tiny_f32_dir, tmp_path, mode):
    """MLX's ring busy-polls a posted receive; a follower waiting for rank 0's next call
    waits in ``select()`` instead, so while the server idles rank 1 uses almost no CPU
    (it used 13-40 % of a core before, shared box). Nor does ``mlx.launch`` itself: its
    per-rank threads spun on the ranks' always-writable stdin pipes (3.0-3.5 CPU-s
    in these 3 s, a whole core, before the ranks filled them). CPU time, not wall time, is judged."""
    import time

    server = _pipeline_server(tiny_f32_dir, tmp_path / "kv", mode=mode)
    try:
        ranks = {_rank_of(p): p for p in _ranks_of(server.proc.pid)}
        time.sleep(1)
        before = _cpu_s(ranks[1])
        launcher = _cpu_s(server.proc.pid)
        time.sleep(3)
        assert _cpu_s(ranks[1]) - before < 0.15
        assert _cpu_s(server.proc.pid) - launcher < 0.3
    finally:
        kill_group(server.proc)
        server.kill()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _decision(line: str) -> str:
    return line.split("/v1/messages ", 1)[1].split()[0]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_pipeline_shutdown_snapshots_per_rank_serve_the_restart(tiny_f32_dir, tmp_path, mode):
    """Two ranks sharing one disk directory (as on loopback): SIGTERM to the launcher
    stops rank 0 gracefully (its parent-death signal) and it orders shutdown snapshots:
    rank 0 writes ``<key>.safetensors``, rank 1 its layers' part ``<key>.rank1.safetensors``
    (in tensor mode its copy of the whole KV). After a restart of both ranks the tool
    results continue from them (decision ``disk``, only the suffix prefilled); a
    one-process server on the same directory skips the split's snapshots as foreign
    (the mode and rank count are part of the model identity), saying so, and prefills
    cold."""
    import time

    import httpx

    from ds4mlx.kv.store import scan_dir

    kv = tmp_path / "kv"
    tools = [{"name": "read", "input_schema": {"type": "object", "properties": {"path": {}}}}]
    body = {
        "model": "m",
        "max_tokens": 2000,
        "tools": tools,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "read a.txt please"}],
    }
    servers = []
    try:
        first = _pipeline_server(tiny_f32_dir, kv, mode=mode)
        servers.append(first)
        first.script(TOOL_SCRIPT)
        r1 = httpx.post(first.url + "/v1/messages", json=body, timeout=120).json()
        (use,) = [b for b in r1["content"] if b["type"] == "tool_use"]
        ranks = _ranks_of(first.proc.pid)
        assert len(ranks) == 2, ranks
        first.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in ranks):
            time.sleep(0.2)
        assert not [p for p in ranks if _alive(p)]
        shutdown = [e.key for e in scan_dir(kv).entries if e.reason == "shutdown"]
        assert shutdown, sorted(p.name for p in kv.iterdir())
        assert all((kv / f"{k}.rank1.safetensors").is_file() for k in shutdown)

        body["messages"] += [
            {"role": "assistant", "content": r1["content"]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "R"}],
            },
        ]
        body["max_tokens"] = 8
        body["thinking"] = {"type": "enabled"}  # a budget must be below max_tokens
        second = _pipeline_server(tiny_f32_dir, kv, mode=mode)
        servers.append(second)
        r2 = httpx.post(second.url + "/v1/messages", json=body, timeout=120).json()
        line = second.request_line(0)
        assert _decision(line) == "disk", second.log()[-3000:]
        live = r1["usage"]["input_tokens"] + r1["usage"]["output_tokens"] - 1
        assert r2["usage"]["cache_read_input_tokens"] == live
        os.killpg(second.proc.pid, signal.SIGKILL)

        alone = _pipeline_server(tiny_f32_dir, kv, ranks=1)
        servers.append(alone)
        assert "0 usable;" in alone.log() and "of other models or contexts" in alone.log()
        httpx.post(alone.url + "/v1/messages", json=body, timeout=120).json()
        assert _decision(alone.request_line(0)) == "cold", alone.log()[-3000:]
    finally:
        for server in servers:
            if server.start_new_session:
                kill_group(server.proc)
            server.kill()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_a_rank_killed_while_the_server_idles_leaves_no_shutdown_snapshot(
    tiny_f32_dir, tmp_path, mode
):
    """SIGKILL of rank 1 while no request runs: nothing rank 0 sends fails, but the
    launcher then SIGTERMs rank 0. Rank 0 sees the closed connection before its shutdown
    saves: it logs ``rank 1 lost: …`` and exits 1 without writing a shutdown snapshot (a
    rank-0 file without its rank-1 part would count as usable on the next start)."""
    import httpx

    from ds4mlx.kv.store import scan_dir

    kv = tmp_path / "kv"
    server = _pipeline_server(tiny_f32_dir, kv, mode=mode)
    try:
        words = " ".join(f"word{i}" for i in range(40))
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": words}]}
        httpx.post(server.url + "/v1/messages", json=body, timeout=120).raise_for_status()
        server.request_line(0)
        ranks = {_rank_of(p): p for p in _ranks_of(server.proc.pid)}
        os.kill(ranks[1], signal.SIGKILL)
        assert _gone(list(ranks.values()), 30), server.log()[-3000:]
        server.proc.wait(10)
        log = server.log()
        assert "rank 1 lost: " in log, log[-3000:]
        assert "rank 0 exited with code 1" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        assert not [e for e in scan_dir(kv).entries if e.reason == "shutdown"], log[-3000:]
    finally:
        kill_group(server.proc)
        server.kill()


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"MLX_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


class _Decoding:
    """``serve --distributed MODE --rank-timeout 5`` on two ranks (own session) with one
    streaming chat request that has started decoding (a text delta came): the reader
    thread collects its SSE lines (``events``)."""

    def __init__(self, model_dir: Path, mode: str):
        from server_util import Server

        self.server = Server(
            model_dir, ctx=4096, extra=["--distributed", mode, "--rank-timeout", "5"]
        )
        under_launcher(self.server)
        self.proc = None
        self.events: list[str] = []

    def __enter__(self):
        import threading

        self.server.start(timeout=300)
        self.proc = self.server.proc
        self.ranks = _ranks_of(self.proc.pid)
        self.by_rank = {_rank_of(p): p for p in self.ranks}
        assert sorted(self.by_rank) == [0, 1], self.ranks
        self.started = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        assert self.started.wait(120)
        return self

    def rank(self, r: int) -> int:
        return self.by_rank[r]

    def _read(self) -> None:
        import httpx

        body = {
            "model": "m",
            "max_tokens": 2000,
            "stream": True,
            "messages": [{"role": "user", "content": "go on"}],
        }
        try:
            with httpx.stream(
                "POST", self.server.url + "/v1/chat/completions", json=body, timeout=120
            ) as r:
                for line in r.iter_lines():
                    self.events.append(line)
                    if _text_delta(line):
                        self.started.set()
        except httpx.HTTPError as e:
            self.events.append(f"transport error: {e}")
        self.started.set()

    def assert_failed_and_stopped(self, within: float) -> None:
        """The stream ended with an error and rank 0 exited, within ``within`` seconds."""
        self.reader.join(within)
        assert not self.reader.is_alive(), self.server.log()[-3000:]
        data = [e for e in self.events if e.strip()]
        assert "lost" in data[-2] or "transport error" in data[-1], data[-3:]
        assert _gone([self.rank(0)], within), self.server.log()[-3000:]

    def assert_all_gone(self) -> str:
        """No rank is left within 10 s and the launcher exited; returns the whole log
        (the launcher relays a rank's last lines only once every rank has ended)."""
        assert _gone(self.ranks, 10), self.server.log()[-3000:]
        self.proc.wait(10)
        log = self.server.log()
        assert "rank 1 lost: " in log, log[-3000:]
        return log

    def __exit__(self, *exc):
        kill_group(self.proc)
        self.server.kill()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_pipeline_rank_killed_mid_request_fails_the_request_and_stops_the_server(
    tiny_f32_dir, mode
):
    """SIGKILL of rank 1 while a stream decodes: the client's stream ends with an error,
    rank 0 logs ``rank 1 lost: …`` and exits, and no rank is left within 10 s. (When the
    ring never reports the dead peer, the 5 s ``--rank-timeout`` ends it the same way.)"""

    with _Decoding(tiny_f32_dir, mode) as run:
        os.kill(run.rank(1), signal.SIGKILL)
        run.assert_failed_and_stopped(within=30)
        run.assert_all_gone()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_a_rank_that_stops_answering_fails_the_request_after_the_rank_timeout(tiny_f32_dir, mode):
    """SIGSTOP of rank 1 while a stream decodes (its sockets stay open: the ring never
    reports it): after ``--rank-timeout 5`` rank 0 logs ``rank 1 lost: no answer within
    5 s (--rank-timeout)``, the stream ends with an error and rank 0 exits with code 1;
    once rank 1 runs again it sees rank 0 gone and exits too."""

    with _Decoding(tiny_f32_dir, mode) as run:
        stopped = run.rank(1)
        os.kill(stopped, signal.SIGSTOP)
        try:
            run.assert_failed_and_stopped(within=60)
        finally:
            os.kill(stopped, signal.SIGCONT)
        log = run.assert_all_gone()
        assert "rank 1 lost: no answer within 5 s (--rank-timeout)" in log, log[-3000:]
        # Rank 0's own exit code, as the launcher reports it (the launcher exits 0).
        assert "rank 0 exited with code 1" in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_follower_whose_rank_0_stops_mid_call_exits_after_the_rank_timeout(tiny_f32_dir):
    """The follower's own timer (tensor mode, ``--rank-timeout 5``): rank 0 stops while
    rank 1 is inside a call. To be sure rank 1 is inside one (it does not bound its wait
    for the next call: the server may idle), rank 1 is stopped first, rank 0 runs on until
    it waits on rank 1 mid-step, then rank 0 is stopped and rank 1 continued: it takes
    what rank 0 had sent and waits for the rest. Within the timeout and the grace rank 1
    exits non-zero with ``rank 0 lost: no answer within 5 s (--rank-timeout)``, and once
    rank 0 runs again no process is left.

    When rank 1 was stopped inside the step's last collective, rank 0 had already sent
    its whole part: rank 1 then finishes the call and waits for the next one, as a
    follower of an idle server does (twice in 9 loaded runs). That stop is undone (rank 0
    continued) and tried again."""
    import time

    with _Decoding(tiny_f32_dir, "tensor") as run:
        zero, one = run.rank(0), run.rank(1)
        for _ in range(5):
            os.kill(one, signal.SIGSTOP)
            try:
                # A decode step takes well under a second; rank 0's own timer gives it 5 s.
                time.sleep(2)
                os.kill(zero, signal.SIGSTOP)
            finally:
                os.kill(one, signal.SIGCONT)
            if not _finishes_its_call(one, within=3):
                break
            os.kill(zero, signal.SIGCONT)
        else:
            raise AssertionError("rank 1 finished its call every time: " + run.server.log()[-3000:])
        try:
            assert _gone([one], 60), run.server.log()[-3000:]
        finally:
            os.kill(zero, signal.SIGCONT)
        assert _gone(run.ranks, 20), run.server.log()[-3000:]
        run.proc.wait(10)
        log = run.server.log()
        # The follower's last line names the rank it lost and why.
        assert "ds4mlx serve: rank 0 lost: no answer within 5 s (--rank-timeout)" in log, log[
            -3000:
        ]
        # 1, as rank 0 for a lost follower (it was 2, the code of a refused flag)
        assert "rank 1 exited with code 1" in log, log[-3000:]


# The system calls a follower's main thread waits in for the next call (``select.select``:
# glibc issues pselect6; older ones select), by machine (`_finishes_its_call`).
_SELECT_CALLS = {"x86_64": {23, 270}, "aarch64": {72}}


def _finishes_its_call(pid: int, within: float) -> bool:
    """Whether follower ``pid``'s main thread is back waiting for the next call (in
    ``select``, read from ``/proc/PID/syscall``) within ``within`` seconds: it had all
    it needed for the call it was in. False when it stays inside the call (or ends)."""
    import platform
    import time

    calls = _SELECT_CALLS.get(platform.machine())
    if calls is None:
        pytest.skip(f"no select system call numbers for {platform.machine()}")
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            word = Path(f"/proc/{pid}/syscall").read_text().split()[0]
        except (OSError, IndexError):
            return False  # gone
        if word.isdigit() and int(word) in calls:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_pipeline_follower_whose_rank_0_dies_exits_naming_it(tiny_f32_dir):
    """SIGKILL of rank 0 while a stream decodes (pipeline mode): the follower's ``recv``
    fails at once, it exits non-zero with ``rank 0 lost: [ring] …`` and no process is
    left. (A rank 0 that is stopped rather than killed between two calls is not seen by a
    pipeline follower: waiting for the next call is not bounded.)"""
    with _Decoding(tiny_f32_dir, "pipeline") as run:
        os.kill(run.rank(0), signal.SIGKILL)
        assert _gone(run.ranks, 20), run.server.log()[-3000:]
        run.proc.wait(10)
        log = run.server.log()
        assert "ds4mlx serve: rank 0 lost: [ring] " in log, log[-3000:]
        # 1, as rank 0 for a lost follower (it was 2, the code of a refused flag)
        assert "rank 1 exited with code 1" in log, log[-3000:]


def _text_delta(line: str) -> bool:
    """An SSE chat chunk carrying visible text or reasoning (decode has started)."""
    import json

    if not line.startswith("data:") or "[DONE]" in line:
        return False
    try:
        choices = json.loads(line[5:]).get("choices") or [{}]
    except ValueError:
        return False
    delta = choices[0].get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content"))


def _gone(pids: list[int], within: float) -> bool:
    """Whether every process of ``pids`` has ended within ``within`` seconds."""
    import time

    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"
