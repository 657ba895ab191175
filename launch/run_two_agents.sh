#!/usr/bin/env bash
# Start a two-model run: the coordinator, then agent B's job, then agent A's job, each only
# once the previous one is healthy.
#   bash launch/run_two_agents.sh [ENV_FILE]        (default: launch/mrlx.env)
# For agents on two nodes, run `run_agent.sh B` on B's node and `run_agent.sh A` on A's node
# instead, with the same env file; the gates below are what A waits for.
set -euo pipefail
here="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
env_file="${1:-$here/mrlx.env}"
# shellcheck source=/dev/null
source "$env_file"
dry="${MRLX_DRY_RUN:-0}"

bash "$here/start_coordinator.sh" "$env_file"

# B: submitted without waiting for the job to end; healthy once its router serves an engine.
MRLX_WAIT=0 bash "$here/run_agent.sh" B "$env_file"
if [ "$dry" != 1 ]; then
  "$PYTHON" -m mrlx_plugin.cli check --config "$AGENT_B_CONFIG" --router-url "$MRLX_URL_B" --responder \
    --skip-tokenizers --wait "${MRLX_START_TIMEOUT:-3600}"
fi

# A: its own check reaches B's router and the coordinator before it starts.
bash "$here/run_agent.sh" A "$env_file"
