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

exec "${CLAUDE:-claude}" --model deepseek-v4-flash "$@"
