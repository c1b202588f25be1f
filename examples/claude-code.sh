#!/usr/bin/env bash
# Claude Code against a local `ds4mlx serve` (Anthropic Messages API on /v1/messages).
#
#   examples/claude-code.sh                 # interactive
#   examples/claude-code.sh -p "explain ds4mlx/server.py"
#
# DS4MLX_URL (default http://127.0.0.1:8000) and DS4MLX_API_KEY (if the server was
# started with --api-key) are honoured; every other argument goes to `claude`.
set -euo pipefail

export ANTHROPIC_BASE_URL="${DS4MLX_URL:-http://127.0.0.1:8000}"
export ANTHROPIC_AUTH_TOKEN="${DS4MLX_API_KEY:-local}"
# One local model for every role Claude Code has (main, background, subagents).
export ANTHROPIC_MODEL="deepseek-v4-flash"
export ANTHROPIC_DEFAULT_OPUS_MODEL="deepseek-v4-flash"
export ANTHROPIC_DEFAULT_SONNET_MODEL="deepseek-v4-flash"
export ANTHROPIC_DEFAULT_HAIKU_MODEL="deepseek-v4-flash"
export CLAUDE_CODE_SUBAGENT_MODEL="deepseek-v4-flash"
# No telemetry, update checks or side requests that would queue behind real work on
# the single inference session.
export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1
# A cold prefill of Claude Code's ~20k-token prompt can take a while on a laptop.
export API_TIMEOUT_MS="${API_TIMEOUT_MS:-3000000}"

# Tell Claude Code the server's real context window (GET /v1/models: context_length),
# or it assumes 200k and runs into the server's limit instead of compacting. Claude Code
# 2.1.x takes a non-Claude model's window from CLAUDE_CODE_MAX_CONTEXT_TOKENS and
# compacts at CLAUDE_CODE_AUTO_COMPACT_WINDOW (capped by that window; alone it cannot go
# below 100k). It keeps ~33k of any window free (output + compaction buffer) on top of
# its own ~19k-token prompt, so below 64k it would refuse every turn ("Prompt is too
# long"): there the window is left alone and a note says so. Set either variable
# yourself to override.
if [[ -z "${CLAUDE_CODE_MAX_CONTEXT_TOKENS:-}" ]]; then
    ctx="$(python3 - "$ANTHROPIC_BASE_URL" "$ANTHROPIC_AUTH_TOKEN" <<'PY' 2>/dev/null || true
import json, sys, urllib.request
req = urllib.request.Request(
    sys.argv[1] + "/v1/models/deepseek-v4-flash", headers={"x-api-key": sys.argv[2]}
)
print(json.load(urllib.request.urlopen(req, timeout=10))["context_length"])
PY
)"
    if [[ ! "$ctx" =~ ^[0-9]+$ ]]; then
        echo "claude-code.sh: cannot read the context size from $ANTHROPIC_BASE_URL" \
            "(is ds4mlx serve running?); Claude Code will assume 200k" >&2
    elif (( ctx < 65536 )); then
        echo "claude-code.sh: the server's context ($ctx tokens) is too small for Claude" \
            "Code to compact in (it keeps ~33k free beside its ~19k prompt); long sessions" \
            "will hit the server's limit. Restart the server with --ctx 65536 or more." >&2
    else
        export CLAUDE_CODE_MAX_CONTEXT_TOKENS="$ctx"
    fi
fi
if [[ -n "${CLAUDE_CODE_MAX_CONTEXT_TOKENS:-}" ]]; then
    export CLAUDE_CODE_AUTO_COMPACT_WINDOW="${CLAUDE_CODE_AUTO_COMPACT_WINDOW:-$CLAUDE_CODE_MAX_CONTEXT_TOKENS}"
fi

exec "${CLAUDE:-claude}" --model deepseek-v4-flash "$@"
