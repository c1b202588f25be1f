"""The event loop never waits on a body (security issue, "one request freezes every
client"): a 31 MB body and a 200k-message body are parsed, validated and rendered off
the loop, refused by the cheap context bound before any tokenizing, and answered with
their protocol's 4xx, while ``/health`` keeps answering and the memory of the server
(its children included) stays bounded.

Before the change, parsing, validation and rendering ran on the event loop and the
whole text was tokenized before the context check: ``/health`` stalled for seconds. On
a thread alone they still did: single calls holding the GIL (JSON parsing, a regex or a
join over 31 MB, and full collections of the cyclic garbage collector, which 200k
messages trigger again and again, 0.3-0.5 s of CPU each) kept ``/health`` waiting
1-2.5 s on a loaded machine. Large bodies are now vetted in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_util import HTTP, Server

pytestmark = pytest.mark.slow

CTX = 4096
# The vetting child's idle lifetime in these servers (``$DS4MLX_VET_IDLE_S``; 30 s by
# default): long enough that the child outlives the gaps between one test's bodies,
# short enough that `test_large_body_paths` does not sleep 30 s waiting for it to exit.
VET_IDLE_S = "5"


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (none once it is gone)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass  # exited meanwhile
    return out


def _vetting_child(pid: int) -> bool:
    """Whether ``pid`` has a multiprocessing worker child (the body-vetting process)."""
    for c in _children(pid):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return True
        except OSError:
            pass  # exited meanwhile
    return False


def _rss_bytes(pid: int) -> int:
    """Resident bytes of process ``pid`` and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue  # exited meanwhile (a zombie has no VmRSS)
        todo += _children(p)
    return total


def poll(url: str, pid: int) -> None:
    """The probe's process: GET ``url/health`` every 50 ms and sample the RSS of ``pid``
    and its children until stdin closes. Prints ``polling`` after the first answer, at
    the end ``{"gaps", "failures", "peak"}`` as JSON (the gaps between two answers in
    seconds, the peak RSS in bytes)."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    gaps: list[float] = []
    failures: list[str] = []
    peak = 0
    # The timeout is the liveness check: a /health that takes longer is a failure. A
    # loop held by a body or a tokenization stalled it 16-18 s; the gaps are printed
    # as a figure, never asserted (the machine's load decides them).
    with httpx.Client(base_url=url, timeout=10) as c:
        last = time.monotonic()
        while not stop.is_set():
            try:
                r = c.get("/health")
                if r.status_code != 200:
                    failures.append(f"status {r.status_code}")
            except httpx.HTTPError as e:
                failures.append(repr(e))
            now = time.monotonic()
            if not gaps:
                print("polling", flush=True)
            gaps.append(now - last)
            last = now
            peak = max(peak, _rss_bytes(pid))
            time.sleep(0.05)
    print(json.dumps({"gaps": gaps, "failures": failures, "peak": peak}))


class _Probe:
    """`poll` in a process of its own, so that what this process does meanwhile (httpx
    sending a 31 MB body holds its GIL for up to a second on a loaded machine) never
    delays a poll: a gap is the server's. After the block: ``gaps``, ``failures``,
    ``peak``."""

    def __init__(self, server: Server):
        self.server = server
        self.gaps: list[float] = []
        self.failures: list[str] = []
        self.peak = 0

    def __enter__(self) -> _Probe:
        code = f"import test_loop_bodies as t; t.poll({self.server.url!r}, {self.server.proc.pid})"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=Path(__file__).parent,
            env=env,
            text=True,
        )
        assert self.proc.stdout.readline().strip() == "polling"  # its first answer came
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self.proc.communicate("", timeout=120)
        res = json.loads(out.strip().splitlines()[-1])
        self.gaps, self.failures, self.peak = res["gaps"], res["failures"], res["peak"]


def _assert_still_serves(server: Server) -> None:
    """A small chat request after the big ones is answered 200."""
    r = HTTP.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=120,
    )
    assert r.status_code == 200, r.text


def _bodies() -> list[tuple[str, str, bytes]]:
    big = "x" * 31_000_000
    many = [{"role": "user", "content": "hi"}] * 200_000
    return [
        ("31MB chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}),
        (
            "31MB messages",
            "/v1/messages",
            {"max_tokens": 4, "messages": [{"role": "user", "content": big}]},
        ),
        ("200k chat", "/v1/chat/completions", {"messages": many}),
        ("200k messages", "/v1/messages", {"max_tokens": 4, "messages": many}),
        ("200k responses", "/v1/responses", {"input": many, "stream": True}),
    ]


@pytest.fixture(scope="module")
def server(tiny_model_dir):  # noqa: F811
    with Server(tiny_model_dir, ctx=CTX, env={"DS4MLX_VET_IDLE_S": VET_IDLE_S}) as s:
        yield s


def test_large_bodies_leave_the_loop_free(server):
    bodies = [(name, path, json.dumps(b).encode()) for name, path, b in _bodies()]
    assert all(len(raw) < 32 * 2**20 for _, _, raw in bodies)
    assert len(bodies[0][2]) > 31_000_000
    with httpx.Client(base_url=server.url, timeout=300) as c:
        # A small body is built in the server: no vetting child, no process hop.
        small = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert c.post("/v1/chat/completions", json=small).status_code == 200
        assert _children(server.proc.pid) == []
        baseline = _rss_bytes(server.proc.pid)
        with _Probe(server) as probe:
            time.sleep(0.3)
            for name, path, raw in bodies:
                r = c.post(path, content=raw, headers={"content-type": "application/json"})
                assert r.status_code == 400, (name, r.status_code, r.text[:300])
                err = r.json()["error"]
                assert err["n_ctx"] == CTX and err["n_prompt_tokens"] > CTX, (name, err)
                if not path.startswith("/v1/messages"):
                    assert err["code"] == "context_length_exceeded", (name, err)
            time.sleep(0.3)
    print(
        f"largest /health gap {max(probe.gaps):.2f} s, peak RSS +{(probe.peak - baseline) / 2**20:.0f}"
        f" MiB, load average {os.getloadavg()[0]:.1f}"
    )
    assert not probe.failures, probe.failures[:3]
    assert len(probe.gaps) > 5
    assert probe.peak - baseline < 2**30, (probe.peak - baseline) / 2**20
    # The server still serves.
    _assert_still_serves(server)


def test_large_body_paths(server):
    """A body over ``VET_BYTES`` takes the vetting hop: accepted, it is still built and
    served here; refused, the child's 4xx is the answer (field path included); a route
    whose function needs what the child lacks (the tokenizer) is answered here."""
    pad = "p" * 1_500_000  # an unknown field: tolerated, never rendered
    hi = [{"role": "user", "content": "hi"}]
    r = HTTP.post(
        server.url + "/v1/chat/completions",
        json={"messages": hi, "max_tokens": 2, "x_pad": pad},
        timeout=300,
    )
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    r = HTTP.post(
        server.url + "/v1/messages",
        json={"max_tokens": 4, "messages": [{"role": "wizard", "content": "hi"}], "x_pad": pad},
        timeout=300,
    )
    assert r.status_code == 400, r.text[:300]
    assert r.json()["type"] == "error" and "messages.0.role" in r.json()["error"]["message"]
    counts = [
        HTTP.post(
            server.url + "/v1/messages/count_tokens",
            json={"messages": hi, **extra},
            timeout=300,
        ).json()["input_tokens"]
        for extra in ({}, {"x_pad": pad})
    ]
    assert counts[0] == counts[1] > 0
    # Idle for VET_IDLE_S (the module's), the child exits and gives its memory back.
    deadline = time.monotonic() + 120
    while _vetting_child(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _vetting_child(server.proc.pid)


# A context wide enough that the character bound (ctx × 128) lets a 6 MB prompt through:
# only counting its tokens tells it cannot fit.
WIDE_CTX = 65536


@pytest.fixture(scope="module")
def wide(tiny_model_dir):  # noqa: F811
    with Server(tiny_model_dir, ctx=WIDE_CTX, extra=["--keepalive", "0.5"]) as s:
        yield s


def _prose(n_chars: int) -> str:
    """Ordinary text (words, digits, punctuation, lines) of about ``n_chars`` characters:
    ~3.5 characters per token, as a pasted log or source file."""
    import random

    rng = random.Random(0)
    words = "the server reads a line of code 42 and (returns) x.y = f(z); # ok".split()
    lines, size = [], 0
    while size < n_chars:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 14)))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


def test_millions_of_tokens_are_refused_early_while_the_loop_answers(wide):
    """A ~6 MB prompt (about 2M tokens) passes the character bound of a 65536-token
    context; its tokens are counted up to the context, off the loop with the GIL
    released, and it is refused with the protocol's ``context_length_exceeded`` 400
    before it is queued, while ``/health`` answers throughout. Before, the worker
    tokenized all of it holding the GIL: ``/health`` waited 16-18 s, the job sat in the
    queue, and a small request meanwhile timed out."""
    text = _prose(6_000_000)
    assert WIDE_CTX * 3 < len(text) < WIDE_CTX * 128
    bodies = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ("/v1/completions", {"prompt": text, "max_tokens": 4}),
    ]
    submitted = wide.health()["submitted"]
    with httpx.Client(base_url=wide.url, timeout=300) as c, _Probe(wide) as probe:
        for path, body in bodies:
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded", err
            assert err["n_ctx"] == WIDE_CTX and err["n_prompt_tokens"] >= WIDE_CTX, err
            assert f"at least {err['n_prompt_tokens']} tokens" in err["message"], err
    assert not probe.failures, probe.failures[:3]
    print(f"largest /health gap {max(probe.gaps):.2f} s, load average {os.getloadavg()[0]:.1f}")
    # Refused before the queue: no job was submitted, and a small request is served.
    assert wide.health()["submitted"] == submitted
    _assert_still_serves(wide)


def test_a_queued_job_whose_client_left_never_runs(wide):
    """While a long job runs, a second request waits in the queue; its client gives up.
    ``/health`` stops counting it at once, and when the worker comes to it, it is dropped
    without running (its log line says so; it has no per-request line)."""
    wide.wait_idle()
    n0 = len(wide.request_lines())
    wide.script(" ".join(f"w{i}" for i in range(3000)))
    hi = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}]}
    with HTTP.stream(
        "POST",
        wide.url + "/v1/chat/completions",
        json={**hi, "max_tokens": 3000, "stream": True},
        timeout=120,
    ) as running:
        lines = running.iter_lines()
        assert next(ln for ln in lines if ln.startswith("data:"))  # it runs
        assert wide.health()["queued"] == 1
        with pytest.raises(httpx.ReadTimeout):  # queued behind it; the client leaves
            HTTP.post(wide.url + "/v1/chat/completions", json={**hi, "max_tokens": 2}, timeout=2)
        deadline = time.monotonic() + 20
        while wide.health()["queued"] != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        h = wide.health()
        assert h["queued"] == 1 and h["busy"] and h["submitted"] >= 2, h
        next(lines)  # the long job still streams
    wide.wait_idle(timeout=60)
    log = wide.log()
    assert "cancelled before it started: client gone" in log, log[-2000:]
    new = wide.request_lines()[n0:]
    assert len(new) == 1 and "finish=cancelled" in new[0], new
