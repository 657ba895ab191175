#!/usr/bin/env bash
# Serve a frozen agent (a judge, a fixed opponent): SGLang servers and a router, no trainer.
#   bash launch/serve_frozen.sh KEY [ENV_FILE]         (default: launch/mrlx.env)
#
# KEY is an agent of MRLX_AGENTS with AGENT_<KEY>_ROLE=frozen. Its variables:
#   AGENT_<KEY>_HF            the model (path or hub name) every server loads
#   AGENT_<KEY>_HOST, _ROUTER_PORT   the router's fixed address (the URL the YAML files name)
#   AGENT_<KEY>_ENGINES       servers (default 1), on ports _ENGINE_PORT, _ENGINE_PORT + 1, ...
#                             (default: the router's port + 1)
#   AGENT_<KEY>_TP            GPUs per server (default 1); server i uses GPUs _BASE_GPU + i * TP on
#   AGENT_<KEY>_BASE_GPU      (default 0) of _CUDA_DEVICES (default: every GPU of the node)
#   AGENT_<KEY>_SERVER_ARGS   more flags for sglang.launch_server (e.g. --mem-fraction-static 0.8)
# Logs and pids go to $MRLX_RUN_DIR/<agent>/. The router waits for its servers (up to
# MRLX_START_TIMEOUT s); `mrlx check --config INITIATOR.yaml --agent NAME --wait S` waits for the
# router to answer, as run_agents.sh does. MRLX_DRY_RUN=1 prints the commands instead. The env
# file is read as data (see agents.sh).
set -euo pipefail
here="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
key="${1:?usage: serve_frozen.sh KEY [ENV_FILE] (KEY: a frozen agent of MRLX_AGENTS in the env file)}"
# shellcheck source-path=SCRIPTDIR source=agents.sh
source "$here/agents.sh"
read_env_file "${2:-$here/mrlx.env}"
require_agents
require_key "$key"
if [ "$(agent_role "$key")" != frozen ]; then
  echo "serve_frozen.sh: '$key' is not a frozen agent ($(agent_prefix "$key")_ROLE is '$(agent_role "$key")'); a trained agent starts with run_agent.sh $key" >&2
  exit 2
fi
v() { agent_var "$key" "$1"; }
# A number of the agent's (AGENT_<KEY>_$1, from $2 to $3, default $4), checked before any use.
agent_int() { int_var "$(agent_prefix "$key")_$1" "$2" "$3" "${4:-}"; }
agent="$(agent_name "$key")"; host="$(v HOST)"; router_port="$(agent_int ROUTER_PORT 1 65535)"
engines="$(agent_int ENGINES 1 1024 1)"
tp="$(agent_int TP 1 1024 1)"
first_port="$(agent_int ENGINE_PORT 1 "$((65536 - engines))" "$((router_port + 1))")"
base_gpu="$(agent_int BASE_GPU 0 1024 0)"
start_timeout="$(int_var MRLX_START_TIMEOUT 1 86400 3600)"
read -r -a extra <<< "$(v SERVER_ARGS)"  # flags, split at blanks (never globbed or run)
devices=()
if [ -n "$(v CUDA_DEVICES)" ]; then devices=(env "CUDA_VISIBLE_DEVICES=$(v CUDA_DEVICES)"); fi
log_dir="$MRLX_RUN_DIR/$agent"; mkdir -p "$log_dir"

workers=()
for ((i = 0; i < engines; i++)); do
  port=$((first_port + i))
  workers+=("http://$host:$port")
  start_bg "$log_dir/server-$i" ${devices[@]+"${devices[@]}"} "$PYTHON" -m sglang.launch_server \
    --model-path "$(v HF)" --host "$host" --port "$port" --tp-size "$tp" --base-gpu-id "$((base_gpu + i * tp))" \
    ${extra[@]+"${extra[@]}"}
done
start_bg "$log_dir/router" "$PYTHON" -m sglang_router.launch_router --host "$host" --port "$router_port" \
  --worker-urls "${workers[@]}" --worker-startup-timeout-secs "$start_timeout" --log-level warn
