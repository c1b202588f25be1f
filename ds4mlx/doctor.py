"""``ds4mlx doctor``: what this machine offers ds4mlx, and whether MLX computes right here.

Run before downloading anything (which DeepSeek V4 Flash builds fit, how much disk is free)
and after (the device checks). The report has

* ``python``, ``mlx`` (version), ``device`` (Metal GPU or CPU, and why),
* ``memory`` (RAM and the budget the fit check uses) and ``wired_limit`` (on a Mac the GPU's
  recommended working set and ``iogpu.wired_limit_mb``, with the ``sysctl`` that raises it),
* ``disk``: free bytes where the KV cache and the models live,
* ``fits``: the fit check's arithmetic (`ds4mlx.model.fit.flash_builds`) per convert build,
* ``checks``: on the default device, the Sinkhorn implementation against
  ``sinkhorn_reference``, one forward pass of the tiny model against the CPU float32 result,
  and a 2-second decode micro-benchmark (``ok``, ``detail`` each),
* ``verdict``: ``"ok"`` or ``"broken: NAMES"``; the command exits 1 when broken.

Test hook: ``DS4MLX_DOCTOR_FAULT=NAME`` (``sinkhorn``, ``forward`` or ``decode``) corrupts that
check's device result on purpose, so the test suite can see the check catch a wrong answer.
It exists for tests only.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

FAULT_ENV = "DS4MLX_DOCTOR_FAULT"
MIN_PYTHON = (3, 11)
DECODE_SECONDS = 2.0
# Largest relative L2 difference of the forward check: bf16 on a GPU against float32 on the
# CPU differs by ~1e-2 on the tiny model; a broken kernel by order 1. CPU vs CPU is ~0.
FORWARD_TOLERANCE = 0.05
SINKHORN_TOLERANCE = 1e-4


@dataclass
class Check:
    """One device check: ``name``, whether it passed, and a one-line ``detail``."""

    name: str
    ok: bool
    detail: str


def _fault(name: str) -> bool:
    return os.environ.get(FAULT_ENV, "") == name


def _device() -> dict:
    import mlx.core as mx

    metal = bool(mx.metal.is_available())
    gpu = mx.default_device() == mx.gpu
    name = "Metal GPU" if metal and gpu else "GPU" if gpu else "CPU"
    info = {"default": name, "metal": metal}
    if metal:
        dev = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        info["name"] = str(dev.get("device_name", ""))
    else:
        info["note"] = (
            f"Metal was not available ({platform.system()} {platform.machine()}): MLX runs "
            "on the CPU, float32; the checks compare the CPU with itself"
        )
    return info


def _sysctl(name: str) -> int | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
        return int(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def _memory() -> tuple[dict, dict]:
    """``(memory, wired_limit)`` sections."""
    import mlx.core as mx

    from ds4mlx.model.fit import device_memory, memory_budget

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget, source = memory_budget()
    memory = {"ram_bytes": int(ram), "budget_bytes": int(budget), "budget_source": source}
    if mx.metal.is_available():
        working, _ = device_memory()
        mb = _sysctl("iogpu.wired_limit_mb")
        wired = {
            "recommended_working_set_bytes": working,
            "iogpu_wired_limit_mb": mb,
            "raise_with": "sudo sysctl iogpu.wired_limit_mb=N (N in MB, e.g. 90% of RAM; "
            "until reboot; at your own risk; then DS4MLX_MEMORY_LIMIT=N MB for the fit check)",
        }
    else:
        wired = {"detail": "Metal was not available: no GPU wired limit; the fit check uses RAM"}
    return memory, wired


def _free(path: Path) -> dict:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return {"path": str(path), "free_bytes": int(shutil.disk_usage(probe).free)}


def _disk(model_dir: str | None) -> dict:
    from ds4mlx.kv.policy import default_disk_dir

    models = model_dir or os.environ.get("DS4MLX_MODEL") or os.environ.get("HF_HOME")
    models = models or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return {"kv_cache": _free(default_disk_dir()), "models": _free(Path(models))}


def _fits(budget: int, source: str) -> list[dict]:
    from ds4mlx.model.fit import flash_builds

    return [
        {
            "build": flags,
            "weights_bytes": r.weights,
            "total_bytes": r.total,
            "ctx": r.ctx_size,
            "fits": r.fits,
        }
        for flags, r in flash_builds(budget, source)
    ]


def check_sinkhorn() -> Check:
    """The default device's Sinkhorn (the Metal/CUDA kernel, or the CPU loop) against the
    numpy reference, on 256 random 4×4 comb logits, 20 iterations."""
    import mlx.core as mx
    import numpy as np

    from ds4mlx.model.sinkhorn import choose_sinkhorn, device_kind
    from ds4mlx.model.sinkhorn_src import sinkhorn_reference

    x = (np.random.default_rng(0).standard_normal((256, 4, 4)) * 2).astype(np.float32)
    got = np.array(choose_sinkhorn()(mx.array(x), 20, 1e-6))
    if _fault("sinkhorn"):
        got = got * 1.5  # test hook: a wrong kernel result
    err = float(np.abs(got - sinkhorn_reference(x, 20, 1e-6)).max())
    return Check(
        "sinkhorn",
        err <= SINKHORN_TOLERANCE,
        f"{device_kind()} implementation vs reference: max abs difference {err:.2e} "
        f"(limit {SINKHORN_TOLERANCE:g})",
    )


def check_forward(tiny: str) -> Check:
    """One forward pass of the tiny model on the default device (bf16 on a GPU) against the
    CPU in float32: relative L2 difference of the logits and top-1 agreement."""
    import mlx.core as mx
    import numpy as np

    from ds4mlx.model.loading import load_model

    ids = mx.array(np.arange(1000, 1200, 7, dtype=np.int32))[None]
    gpu = mx.default_device() == mx.gpu
    model, _ = load_model(tiny, dtype=mx.bfloat16 if gpu else mx.float32, check_memory=False)
    here = np.array(model(ids)[0].astype(mx.float32))
    with mx.stream(mx.cpu):
        ref_model, _ = load_model(tiny, dtype=mx.float32, check_memory=False)
        ref = np.array(ref_model(ids)[0])
    if _fault("forward"):
        here = here[::-1].copy()  # test hook: logits of the wrong positions
    rel = float(np.linalg.norm(here - ref) / max(np.linalg.norm(ref), 1e-30))
    top1 = float((here.argmax(-1) == ref.argmax(-1)).mean())
    where = "GPU bf16" if gpu else "CPU float32"
    return Check(
        "forward",
        rel <= FORWARD_TOLERANCE,
        f"tiny model, {ids.shape[1]} positions, {where} vs CPU float32: relative difference "
        f"{rel:.2e} (limit {FORWARD_TOLERANCE:g}), top-1 agreement {top1:.2f}",
    )


def check_decode(tiny: str, seconds: float = DECODE_SECONDS) -> Check:
    """Greedy decode on the tiny model for ``seconds``: tokens/s, and that every step gave
    finite logits."""
    import mlx.core as mx

    from ds4mlx.engine import Engine

    engine = Engine.load(tiny, ctx_size=4096)
    s = engine.session
    s.prefill(engine.tokenizer.encode("The doctor measures decode speed."))
    n, finite, t0 = 0, True, time.perf_counter()
    token = int(mx.argmax(s.logits).item())
    while time.perf_counter() - t0 < seconds and s.room() > 1:
        logits = s.decode(token)
        token = int(mx.argmax(logits).item())
        finite = finite and bool(mx.isfinite(logits).all().item())
        n += 1
    rate = n / (time.perf_counter() - t0)
    if _fault("decode"):
        finite = False  # test hook: a non-finite step
    return Check(
        "decode",
        finite and n > 0,
        f"tiny model: {n} tokens in {seconds:g} s, {rate:.1f} tok/s"
        + ("" if finite else "; NON-FINITE logits"),
    )


def _run_check(fn: Callable[[], Check], name: str) -> Check:
    try:
        return fn()
    except Exception as e:  # a crashed check is a failed check, reported by name
        return Check(name, False, f"{type(e).__name__}: {e}")


def diagnose(model_dir: str | None = None) -> dict:
    """The whole report as a JSON-ready dict (fields: python, mlx, device, memory,
    wired_limit, disk, fits, checks, verdict)."""
    import mlx.core as mx

    from ds4mlx.model.tiny import make_tiny

    py_ok = sys.version_info[:2] >= MIN_PYTHON
    memory, wired = _memory()
    report = {
        "python": {
            "version": platform.python_version(),
            "executable": sys.executable,
            "ok": py_ok,
            "in_venv": sys.prefix != sys.base_prefix,
        },
        "mlx": {"version": getattr(mx, "__version__", "unknown")},
        "device": _device(),
        "memory": memory,
        "wired_limit": wired,
        "disk": _disk(model_dir),
        "fits": _fits(memory["budget_bytes"], memory["budget_source"]),
    }
    checks = []
    with tempfile.TemporaryDirectory(prefix="ds4mlx-doctor-") as tmp:
        tiny = str(Path(tmp) / "tiny")
        make_tiny(tiny, expert_bits=None, other_bits=None)
        checks.append(_run_check(check_sinkhorn, "sinkhorn"))
        checks.append(_run_check(lambda: check_forward(tiny), "forward"))
        checks.append(_run_check(lambda: check_decode(tiny), "decode"))
    if not py_ok:
        want = ".".join(map(str, MIN_PYTHON))
        checks.insert(0, Check("python", False, f"Python {want} or newer is needed"))
    report["checks"] = [asdict(c) for c in checks]
    broken = [c.name for c in checks if not c.ok]
    report["verdict"] = "broken: " + ", ".join(broken) if broken else "ok"
    return report


def _gb(n: float | None) -> str:
    from ds4mlx.model.units import format_bytes

    return "?" if n is None else format_bytes(n)


def print_report(report: dict) -> None:
    """The report as tables on stdout (rich)."""
    from rich.console import Console
    from rich.table import Table

    con = Console()
    dev, mem, wired = report["device"], report["memory"], report["wired_limit"]
    t = Table(title="ds4mlx doctor", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    py = report["python"]
    t.add_row("python", f"{py['version']} ({'venv' if py['in_venv'] else 'no venv'})")
    t.add_row("mlx", report["mlx"]["version"])
    t.add_row("device", dev["default"] + (f" ({dev['name']})" if dev.get("name") else ""))
    if dev.get("note"):
        t.add_row("", dev["note"])
    t.add_row("memory", f"RAM {_gb(mem['ram_bytes'])}; fit budget {_gb(mem['budget_bytes'])} "
              f"({mem['budget_source']})")  # fmt: skip
    if "detail" in wired:
        t.add_row("wired limit", wired["detail"])
    else:
        mb = wired["iogpu_wired_limit_mb"]
        t.add_row("wired limit", f"recommended working set {_gb(wired['recommended_working_set_bytes'])}"
                  f"; iogpu.wired_limit_mb={mb if mb is not None else '?'} (0 = default)")  # fmt: skip
        t.add_row("", "raise: " + wired["raise_with"])
    for k, d in report["disk"].items():
        t.add_row(f"disk ({k})", f"{_gb(d['free_bytes'])} free at {d['path']}")
    con.print(t)
    f = Table(title="DeepSeek V4 Flash builds (computed, not verified), ctx 65536, 1 session",
              title_justify="left")  # fmt: skip
    for col in ("ds4mlx convert flags", "weights", "total", "fits"):
        f.add_column(col)
    for row in report["fits"]:
        f.add_row(row["build"], _gb(row["weights_bytes"]), _gb(row["total_bytes"]),
                  "yes" if row["fits"] else "no")  # fmt: skip
    con.print(f)
    c = Table(title="checks on this device", title_justify="left")
    for col in ("check", "ok", "detail"):
        c.add_column(col)
    for row in report["checks"]:
        c.add_row(row["name"], "ok" if row["ok"] else "[red]FAILED[/red]", row["detail"])
    con.print(c)
    style = "green" if report["verdict"] == "ok" else "bold red"
    con.print(f"verdict: [{style}]{report['verdict']}[/{style}]")


def run(args) -> int:
    """``ds4mlx doctor [--json] [--model-dir DIR]``: 0 when every check passes, else 1."""
    report = diagnose(getattr(args, "model_dir", None))
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["verdict"] == "ok" else 1
