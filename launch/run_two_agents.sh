#!/usr/bin/env bash
# Start a two-model run: the coordinator, then agent B's job, then agent A's job, each only
# once the previous one is healthy.
#   bash launch/run_two_agents.sh [ENV_FILE]        (default: launch/mrlx.env)
# For agents on two nodes, run `run_agent.sh B` on B's node and `run_agent.sh A` on A's node
# instead, with the same env file; the gates are what A waits for. This is run_agents.sh with
# the two agents of launch/mrlx.env (A the initiator, B a responder).
set -euo pipefail
here="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$here/run_agents.sh" "${1:-$here/mrlx.env}"
