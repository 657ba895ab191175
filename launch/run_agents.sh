#!/usr/bin/env bash
# Start a multi-model run of any number of agents, each step once the previous one is healthy:
#   1. every trained agent's settings, checked against each other (no GPU used);
#   2. the coordinator, when an agent is trained by a job other than the initiator's;
#   3. each frozen agent's SGLang servers and router (serve_frozen.sh), waited for;
#   4. each responder's slime job (submitted without waiting for it to end), waited for;
#   5. the initiator's slime job, whose own check reaches every other agent first.
#   bash launch/run_agents.sh [ENV_FILE]        (default: launch/mrlx.env)
# The env file lists the agents (MRLX_AGENTS, see agents.sh); launch/debate.env is a three-model
# example. For agents on several nodes, run the steps' scripts on each node instead, with the
# same env file. MRLX_DRY_RUN=1 prints the commands, in order, instead of running them. The env
# file is read as data (see agents.sh).
set -euo pipefail
here="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
env_file="${1:-$here/mrlx.env}"
# shellcheck source-path=SCRIPTDIR source=agents.sh
source "$here/agents.sh"
read_env_file "$env_file"
require_agents
initiator="$(agents_with_role initiator)"
initiator_config="$(agent_var "$initiator" CONFIG)"
wait_s="$(int_var MRLX_START_TIMEOUT 1 86400 3600)"  # the most `mrlx check --wait` takes: a day

run "$PYTHON" -m mrlx_plugin.cli check --offline "${CHECK_ARGS[@]}"

if [ -n "$(agents_with_role responder)" ]; then
  bash "$here/start_coordinator.sh" "$env_file"
fi

for key in $(agents_with_role frozen); do
  bash "$here/serve_frozen.sh" "$key" "$env_file"
  run "$PYTHON" -m mrlx_plugin.cli check --config "$initiator_config" --agent "$(agent_name "$key")" \
    --skip-tokenizers --wait "$wait_s"
done

# A responder is healthy once its router serves an engine.
for key in $(agents_with_role responder); do
  MRLX_WAIT=0 bash "$here/run_agent.sh" "$key" "$env_file"
  run "$PYTHON" -m mrlx_plugin.cli check --config "$(agent_var "$key" CONFIG)" --router-url "$(agent_url "$key")" \
    --responder --skip-tokenizers --wait "$wait_s"
done

bash "$here/run_agent.sh" "$initiator" "$env_file"
