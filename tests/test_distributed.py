"""Pipeline parallelism over MLX distributed: two ring ranks on 127.0.0.1 against one
process (`ds4mlx.engine.pipeline`).

The ranks run ``tests/dist_script.py`` under ``mlx.launch``. The launcher exits 0 even
when a rank fails, so each run is judged by the file rank 0 writes and the launcher's
own per-rank warnings; the launcher runs in its own process group, killed at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.engine.pipeline import PipelineError, split_layers

SCRIPT = Path(__file__).with_name("dist_script.py")
N_PROMPT, CHUNK = 300, 64


def _free_port_pair() -> int:
    """A port P with P and P + 1 free (the ring listens on one port per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def _launcher() -> str:
    launcher = shutil.which("mlx.launch")
    if launcher is None:
        pytest.skip("mlx.launch is not on PATH")
    return launcher


def _ring(argv: list[str]) -> list[str]:
    """``argv`` (a python command) under ``mlx.launch`` as two ring ranks on loopback."""
    return [
        _launcher(),
        "--backend",
        "ring",
        "--hosts",
        "127.0.0.1,127.0.0.1",
        "--starting-port",
        str(_free_port_pair()),
        "--",
        *argv,
    ]


def _launch(model_dir: Path, out: Path, split: str | None, timeout: float = 600) -> str:
    cmd = _ring(
        [
            sys.executable,
            str(SCRIPT),
            str(model_dir),
            str(out),
            str(N_PROMPT),
            str(CHUNK),
            *([split] if split else []),
        ]
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SCRIPT.parents[1]), *sys.path]))
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert "exited with code" not in log, log[-3000:]
    assert out.exists(), log[-3000:]
    return log


def _reference(model_dir: Path) -> dict[str, np.ndarray]:
    """The same feeds in one process: full prefill logits per chunk, 8 greedy decode
    steps, and a greedy 32-token turn."""
    from dist_script import feeds

    from ds4mlx.engine import Engine, SamplingParams, TurnSpec, run_turn
    from ds4mlx.model.loading import load_model, read_config
    from ds4mlx.tokenizer import Tokenizer

    model, args = load_model(str(model_dir), dtype=mx.float32, check_memory=False)
    prompt = np.random.default_rng(0).integers(0, args.vocab_size, N_PROMPT).tolist()
    prefill, decode = feeds(model, prompt, CHUNK)
    engine = Engine(
        model, args, Tokenizer.load(model_dir), path=model_dir, config=read_config(model_dir)
    )
    session = engine.new_session()
    spec = TurnSpec(SamplingParams(temperature=0.0), max_tokens=32, parse=False, ignore_eos=True)
    run_turn(session, engine.tokenizer, spec, prefill=prompt)
    return {
        "prefill": prefill,
        "decode": decode,
        "turn": np.array(session.tokens[N_PROMPT:], dtype=np.int64),
        "identity": np.array(engine.identity),
    }


@pytest.fixture(scope="module")
def reference(tiny_f32_dir):
    return _reference(tiny_f32_dir)


@pytest.mark.slow
@pytest.mark.parametrize("split", [None, "1"], ids=["even-2+2", "split-1+3"])
def test_pipeline_two_ranks_match_one_process_bitwise(tiny_f32_dir, reference, tmp_path, split):
    """A prompt crossing the sliding window (16 in the tiny config), the ratio-4 and the
    ratio-128 compression boundaries, fed in the same chunks: logits at every prefill
    position and over 8 decode steps are bitwise equal, and the greedy turn through the
    one turn loop (pipelined decode) is the same. The 1+3 split puts a hash-routed layer
    on rank 1, which needs the token ids."""
    out = tmp_path / "out.npz"
    _launch(tiny_f32_dir, out, split)
    got = np.load(out)
    assert got["prefill"].shape == reference["prefill"].shape
    assert np.array_equal(got["prefill"], reference["prefill"])
    assert np.array_equal(got["decode"], reference["decode"])
    assert got["turn"].tolist() == reference["turn"].tolist()
    assert len(got["turn"]) >= 31  # the last sampled token is not fed


@pytest.mark.slow
def test_tensor_two_ranks_match_one_process(tiny_f32_dir, reference, tmp_path):
    """``--distributed tensor`` on two ranks (heads, output groups and every expert's
    intermediate dim split; partial sums completed by ``all_sum``): over the same prompt
    and chunks as the pipeline test, the logits at every prefill position and over 8
    decode steps are within 1e-4 of one process relative to the logits' scale (the
    partial sums are reduced in another order, so not bitwise; max |diff| was 5.2e-6
    over logits of magnitude ~6), the greedy 32-token turn is the same (a snapshot
    restored in memory continues identically, checked by the script), and the split
    enters the model identity."""
    out = tmp_path / "out.npz"
    _launch(tiny_f32_dir, out, "tensor")
    got = np.load(out)
    for key in ("prefill", "decode"):
        ref = reference[key]
        assert got[key].shape == ref.shape
        diff = np.abs(got[key] - ref).max()
        assert diff <= 1e-4 * np.abs(ref).max(), (key, diff)
    assert got["turn"].tolist() == reference["turn"].tolist()
    assert len(got["turn"]) >= 31
    assert str(got["layout"]) == "tensor:2"
    assert str(got["identity"]) != str(reference["identity"])


class _Ranks:
    """A process group's shape only (`shard_model` reads nothing else before refusing)."""

    def __init__(self, size: int):
        self._size = size

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self._size


def test_tensor_split_refuses_heads_that_do_not_divide(tiny_f32_dir):
    """The tiny model's 4 query heads in 2 output groups do not split across 3 ranks:
    one line before any weight is read."""
    from ds4mlx.engine.tensor import shard_model
    from ds4mlx.model.loading import load_model

    model, _ = load_model(str(tiny_f32_dir), dtype=mx.float32, check_memory=False)
    with pytest.raises(PipelineError, match="4 query heads in 2 output groups .* 3 ranks"):
        shard_model(model, _Ranks(3))


def test_tensor_slices_of_a_quantized_linear_add_up_to_the_whole():
    """A quantized linear split at whole quantization groups: the input-column slices'
    outputs add up to the whole output (``wo_b``, ``w2``), the output-row slices stack to it
    (``wq_b``, ``w1``/``w3``); a split inside a group is refused."""
    import copy

    import mlx.nn as nn

    from ds4mlx.engine.tensor import _slice

    mx.random.seed(0)
    whole = nn.QuantizedLinear(128, 16, bias=False, group_size=32, bits=4)
    x = mx.random.normal((3, 128))
    want = whole(x)
    cols, rows = [], []
    for r in range(2):
        part = copy.deepcopy(whole)
        _slice(part, -1, r, 2, "wo_b")
        cols.append(part(x[:, r * 64 : (r + 1) * 64]))
        part = copy.deepcopy(whole)
        _slice(part, 0, r, 2, "wq_b")
        rows.append(part(x))
    assert mx.allclose(cols[0] + cols[1], want, rtol=1e-5, atol=1e-5).item()
    assert mx.array_equal(mx.concatenate(rows, axis=-1), want).item()
    with pytest.raises(PipelineError, match="w2.weight has 16 along the split axis"):
        _slice(copy.deepcopy(whole), -1, 0, 3, "w2")
    one_group = nn.QuantizedLinear(64, 16, bias=False, group_size=64, bits=4)
    with pytest.raises(PipelineError, match="w2.scales has 1 along the split axis"):
        _slice(one_group, -1, 0, 2, "w2")
    assert one_group.weight.shape == (16, 8)  # left whole


def test_split_layers_even_and_explicit():
    assert split_layers(43, 2) == [range(0, 22), range(22, 43)]
    assert split_layers(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert split_layers(43, 2, [10]) == [range(0, 10), range(10, 43)]


@pytest.mark.parametrize(
    "n, world, starts, words",
    [
        (4, 5, None, "only 4 layers"),
        (4, 2, [0], "non-empty"),
        (4, 2, [4], "non-empty"),
        (4, 3, [2, 2], "non-empty"),
        (4, 2, [1, 2], "names 2 start"),
    ],
)
def test_split_layers_refuses_bad_splits(n, world, starts, words):
    with pytest.raises(PipelineError, match=words):
        split_layers(n, world, starts)


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

    server = Server(tiny_f32_dir, ctx=4096, extra=["--distributed", mode], kv_dir=False)
    server.cmd = _ring(server.cmd)
    # Its own session, so the ranks can be found (and killed) as one group.
    server.start_new_session = True
    proc = None
    try:
        server.start(timeout=300)
        proc = server.proc
        assert "disk KV cache is off" in server.log()
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
            "max_tokens": 200,
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
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
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


# Known open problem (issue 27): now and then rank 0 does not notice the killed peer at
# all (no ring error; its step waits in mx.eval) and the request hangs, seen on loopback
# under load in either mode. A step timeout (--rank-timeout) is the planned fix; until
# then the outcome is recorded, not required.
_HANGS = pytest.mark.xfail(reason="a killed peer is sometimes not noticed (issue 27)", strict=False)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    "mode", [pytest.param("pipeline", marks=_HANGS), pytest.param("tensor", marks=_HANGS)]
)
def test_pipeline_rank_killed_mid_request_fails_the_request_and_stops_the_server(
    tiny_f32_dir, mode
):
    """SIGKILL of rank 1 while a stream decodes: the client's stream ends with an error,
    rank 0 logs ``rank 1 lost: …`` and stops, and no rank is left within 10 s."""
    import threading
    import time

    import httpx
    from server_util import Server

    server = Server(tiny_f32_dir, ctx=4096, extra=["--distributed", mode], kv_dir=False)
    server.cmd = _ring(server.cmd)
    server.start_new_session = True
    proc = None
    try:
        server.start(timeout=300)
        proc = server.proc
        ranks = _ranks_of(proc.pid)
        assert sorted(_rank_of(p) for p in ranks) == [0, 1], ranks
        body = {
            "model": "m",
            "max_tokens": 2000,
            "stream": True,
            "messages": [{"role": "user", "content": "go on"}],
        }
        events: list[str] = []
        started = threading.Event()

        def read() -> None:
            try:
                with httpx.stream(
                    "POST", server.url + "/v1/chat/completions", json=body, timeout=120
                ) as r:
                    for line in r.iter_lines():
                        events.append(line)
                        # Killed while decoding (a text delta came): a peer killed
                        # mid-prefill is not always noticed by the ring on loopback.
                        if _text_delta(line):
                            started.set()
            except httpx.HTTPError as e:
                events.append(f"transport error: {e}")
            started.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert started.wait(120)
        os.kill(next(p for p in ranks if _rank_of(p) == 1), signal.SIGKILL)
        reader.join(60)
        assert not reader.is_alive()
        data = [e for e in events if e.strip()]
        assert "lost" in data[-2] or "transport error" in data[-1], data[-3:]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            any(_alive(p) for p in ranks) or proc.poll() is None
        ):
            time.sleep(0.2)
        assert "rank 1 lost: " in server.log(), server.log()[-3000:]
        assert not [p for p in ranks if _alive(p)], server.log()[-3000:]
        assert proc.poll() is not None
    finally:
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.kill()


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


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def test_speculation_is_refused_on_a_split_model(tiny_f32_dir):
    """A verify writes rejected rows into every rank's caches, which the followers cannot
    rewind: drafting is refused under a split (at start, with one line)."""
    from ds4mlx.engine import Engine
    from ds4mlx.engine.speculative import speculation_for
    from ds4mlx.model.loading import load_model, read_config
    from ds4mlx.tokenizer import Tokenizer

    model, args = load_model(str(tiny_f32_dir), dtype=mx.float32, check_memory=False)
    config = read_config(str(tiny_f32_dir))
    tok = Tokenizer.load(tiny_f32_dir)
    split = Engine(model, args, tok, path=tiny_f32_dir, config=config, layout="pipeline:0-2,2-4")
    plain = Engine(model, args, tok, path=tiny_f32_dir, config=config)
    assert split.identity != plain.identity  # nothing saved under one is used by the other
    with pytest.raises(ValueError, match="not supported with --distributed"):
        speculation_for(split, "lookup")
    assert speculation_for(split, "off") is not None
    assert speculation_for(plain, "lookup") is not None
