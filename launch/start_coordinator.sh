#!/usr/bin/env bash
# Start the coordinator of a multi-model run and wait until it answers /health.
#   bash launch/start_coordinator.sh [ENV_FILE]        (default: launch/mrlx.env)
# It serves the trained agents of the env file (initiator and responders; frozen agents have no
# trainer). Writes its pid to $MRLX_RUN_DIR/coordinator.pid and its log to
# $MRLX_RUN_DIR/coordinator.log. Creates a random token in $MRLX_TOKEN_FILE (mode 600) when the
# file does not exist yet. MRLX_DRY_RUN=1 prints the command instead. The env file is read as
# data (see agents.sh).
set -euo pipefail
here="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=agents.sh
source "$here/agents.sh"
read_env_file "${1:-$here/mrlx.env}"
require_agents
port="$(int_var MRLX_COORDINATOR_PORT 1 65535)"; max_depth="$(int_var MRLX_MAX_DEPTH 1 1000000000)"
cmd=("$PYTHON" -m mrlx_plugin.cli coordinator --db "$MRLX_COORDINATOR_DB"
  --host "$MRLX_COORDINATOR_HOST" --port "$port" --run-id "$MRLX_RUN_ID" --agents "$TRAINED_NAMES"
  --token-file "$MRLX_TOKEN_FILE" --max-depth "$max_depth")
if [ "${MRLX_DRY_RUN:-0}" = 1 ]; then run "${cmd[@]}"; exit 0; fi

mkdir -p "$MRLX_RUN_DIR" "$(dirname "$MRLX_COORDINATOR_DB")" "$(dirname "$MRLX_TOKEN_FILE")"
if [ ! -s "$MRLX_TOKEN_FILE" ]; then
  (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(32))' > "$MRLX_TOKEN_FILE")
fi

pidfile="$MRLX_RUN_DIR/coordinator.pid"
if [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
  echo "coordinator already running (pid $(cat "$pidfile")) at $MRLX_COORDINATOR_URL"
  exit 0
fi

start_bg "$MRLX_RUN_DIR/coordinator" "${cmd[@]}"

for _ in $(seq 1 300); do
  if "$PYTHON" - "$MRLX_COORDINATOR_URL/health" <<'PY' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=2).read()
PY
    echo "coordinator up at $MRLX_COORDINATOR_URL (run $MRLX_RUN_ID, pid $(cat "$pidfile"))"
    exit 0
  fi
  if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "coordinator exited; last lines of $MRLX_RUN_DIR/coordinator.log:" >&2
    tail -n 20 "$MRLX_RUN_DIR/coordinator.log" >&2
    exit 1
  fi
  sleep 0.2
done
echo "coordinator did not answer $MRLX_COORDINATOR_URL/health within 60 s" >&2
exit 1
