#!/usr/bin/env bash
# GPU check for an NVIDIA machine with no network and no MLX (docs/KERNELS.md).
#
# Compiles the mHC Sinkhorn kernel body (ds4mlx/model/sinkhorn_src.py, the text the MLX
# Metal/CUDA wrappers use) with CuPy RawKernel, checks it against the numpy reference of
# the same loop (and a torch loop when torch is there), and times it. Under 5 minutes.
#
# Usage (from the repository root): bash benchmarks/gpu_check.sh
# Writes benchmarks output to $OUT/gpu_check.jsonl when $OUT is set, else to stdout only.
set -u
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
echo "== host: $(uname -srm); $($PY --version 2>&1)"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
else
    echo "nvidia-smi not found"
fi
$PY - <<'EOF'
import importlib
for name in ("numpy", "cupy", "torch", "mlx"):
    try:
        m = importlib.import_module(name)
        print(f"== {name} {getattr(m, '__version__', '?')}")
    except Exception as e:  # report, do not fail: only numpy + cupy are required
        print(f"== {name}: not available ({type(e).__name__})")
EOF

log=/dev/null
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    log="$OUT/gpu_check.jsonl"
fi
timeout 280 "$PY" benchmarks/gpu_check.py | tee "$log"
rc=${PIPESTATUS[0]}
echo "== gpu_check.py exit status $rc"
exit "$rc"
