#!/usr/bin/env bash
# Claude Code against a local `ds4mlx serve` (Anthropic Messages API on /v1/messages).
#
#   examples/claude-code.sh                 # interactive
#   examples/claude-code.sh -p "explain ds4mlx/server.py"
#
# DS4MLX_URL (default http://127.0.0.1:8000) and DS4MLX_API_KEY (if the server was
# started with --api-key) are honoured; every other argument goes to `claude`.
# CLAUDE=/path/to/claude picks the Claude Code executable; without it the script uses
# `claude` on PATH, else the copy `npm install --prefix tests/clients` (README) put in
# this checkout.
set -euo pipefail

export ANTHROPIC_BASE_URL="${DS4MLX_URL:-http://127.0.0.1:8000}"
export ANTHROPIC_AUTH_TOKEN="${DS4MLX_API_KEY:-local}"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -z "${CLAUDE:-}" ]]; then
    if command -v claude >/dev/null; then
        CLAUDE=claude
    elif [[ -x "$here/../tests/clients/node_modules/.bin/claude" ]]; then
        CLAUDE="$here/../tests/clients/node_modules/.bin/claude"
    else
        echo "claude-code.sh: Claude Code not found: install it (npm install -g" \
            "@anthropic-ai/claude-code) or point CLAUDE=/path/to/claude at one" >&2
        exit 1
    fi
fi

# Stop at once when nothing answers (Claude Code would wait out API_TIMEOUT_MS, below).
if ! python3 - "$ANTHROPIC_BASE_URL" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + "/health", timeout=5).read()
PY
then
    echo "claude-code.sh: no server at $ANTHROPIC_BASE_URL (start one: ds4mlx serve --demo," \
        "or set DS4MLX_URL)" >&2
    exit 1
fi
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

# Tell Claude Code the server's real context window (GET /v1/models: context_length), or
# it assumes 200k. Claude Code 2.1.x takes a non-Claude model's window from
# CLAUDE_CODE_MAX_CONTEXT_TOKENS and compacts in one of two ways:
# - with CLAUDE_CODE_AUTO_COMPACT_WINDOW set (capped by that window), before sending, once
#   the conversation reaches the window less 33k (20k kept for output, a 13k buffer); it
#   refuses locally ("Prompt is too long") at the window less 23k;
# - without it, when the server refuses a prompt with "prompt is too long: N tokens > M
#   maximum" (what ds4mlx's Messages API answers): it summarizes the older turns and
#   retries.
# The first needs the window less 33k to clear Claude Code's own ~19k-token prompt, so it
# is used from 64k on; below that the second, at the server's real limit. Set either
# variable yourself to override.
if [[ -z "${CLAUDE_CODE_MAX_CONTEXT_TOKENS:-}" ]]; then
    ctx="$(python3 - "$ANTHROPIC_BASE_URL" "$ANTHROPIC_AUTH_TOKEN" <<'PY' 2>/dev/null || true
import json, sys, urllib.error, urllib.request
req = urllib.request.Request(
    sys.argv[1] + "/v1/models/deepseek-v4-flash", headers={"x-api-key": sys.argv[2]}
)
try:
    print(json.load(urllib.request.urlopen(req, timeout=10))["context_length"])
except urllib.error.HTTPError as e:
    print(f"http {e.code}")
PY
)"
    if [[ "$ctx" == "http 401" ]]; then
        # /health needs no key, so only this request tells: Claude Code itself would
        # retry the 401 for minutes before saying so.
        echo "claude-code.sh: the server at $ANTHROPIC_BASE_URL wants an API key" \
            "(serve --api-key): set DS4MLX_API_KEY to it" >&2
        exit 1
    elif [[ "$ctx" =~ ^[0-9]+$ ]]; then
        export CLAUDE_CODE_MAX_CONTEXT_TOKENS="$ctx"
    else
        echo "claude-code.sh: cannot read the context size from $ANTHROPIC_BASE_URL" \
            "(is ds4mlx serve running?); Claude Code will assume 200k" >&2
    fi
fi
window="${CLAUDE_CODE_MAX_CONTEXT_TOKENS:-}"
if [[ "$window" =~ ^[0-9]+$ && -z "${CLAUDE_CODE_AUTO_COMPACT_WINDOW:-}" ]]; then
    if (( window >= 65536 )); then
        export CLAUDE_CODE_AUTO_COMPACT_WINDOW="$window"
    else
        echo "claude-code.sh: with a $window-token context Claude Code compacts only when" \
            "the server refuses a prompt as too long, and the files it re-reads after" \
            "compacting can fill the window again; serve it with --ctx 65536 or more." >&2
    fi
fi

exec "$CLAUDE" --model deepseek-v4-flash "$@"
