#!/usr/bin/env bash
# Start one trained agent's slime job of a multi-model run.
#   bash launch/run_agent.sh KEY [ENV_FILE]         (default: launch/mrlx.env)
#
# KEY is an agent's key in the env file's MRLX_AGENTS (A or B in a two-model env file). The
# initiator's job runs every episode (mrlx_plugin.rollout.initiator_rollout); a responder's
# trains on its part of them (mrlx_plugin.rollout.responder_rollout); a frozen agent has no job
# (serve_frozen.sh). Each job has its own Ray head, and its own sglang-router at the fixed
# address of the env file; slime, given --sglang-router-ip/port, starts no router of its own and
# registers its engines there, so the other jobs can reach them. MRLX_DRY_RUN=1 prints the
# commands instead of running them. MRLX_WAIT=0 submits the job and returns (run_agents.sh does
# this for responders). The env file is read as data (see agents.sh).
set -euo pipefail
here="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
key="${1:?usage: run_agent.sh KEY [ENV_FILE] (KEY: an agent of MRLX_AGENTS in the env file, e.g. A or B)}"
# shellcheck source-path=SCRIPTDIR source=agents.sh
source "$here/agents.sh"
read_env_file "${2:-$here/mrlx.env}"
require_agents

require_key "$key"
role="$(agent_role "$key")"
case "$role" in
  initiator) rollout_fn=mrlx_plugin.rollout.initiator_rollout ;;
  responder) rollout_fn=mrlx_plugin.rollout.responder_rollout ;;
  *) echo "run_agent.sh: '$key' is frozen (no slime job); start its servers with serve_frozen.sh $key" >&2; exit 2 ;;
esac
v() { agent_var "$key" "$1"; }
# A number of the agent's (AGENT_<KEY>_$1, from $2 to $3), checked before any use.
agent_int() { int_var "$(agent_prefix "$key")_$1" "$2" "$3"; }
agent="$(agent_name "$key")"
config="$(v CONFIG)"; host="$(v HOST)"
router_port="$(agent_int ROUTER_PORT 1 65535)"; ray_port="$(agent_int RAY_PORT 1 65535)"
dashboard_port="$(agent_int DASHBOARD_PORT 1 65535)"
gpus="$(agent_int GPUS 1 1024)"; tp="$(agent_int TP 1 1024)"
gpus_per_engine="$(agent_int GPUS_PER_ENGINE 1 1024)"
if [ "$role" = responder ]; then rollout_gpus="$(agent_int ROLLOUT_GPUS 1 1024)"; fi
batch="$(int_var MRLX_ROLLOUT_BATCH_SIZE 1 1000000)"
per_prompt="$(int_var MRLX_N_SAMPLES_PER_PROMPT 1 1000000)"
num_rollout="$(int_var MRLX_NUM_ROLLOUT 1 1000000000)"
context_len="$(int_var MRLX_MAX_CONTEXT_LEN 1 2147483647)"
response_len="$(int_var MRLX_MAX_RESPONSE_LEN 1 2147483647)"
log_dir="$MRLX_RUN_DIR/$agent"; mkdir -p "$log_dir"

# 1. Every trained agent's job settings, checked against each other (imports the hook modules; no
#    GPU used), then what this job will call: the coordinator, and for the initiator, every
#    other agent's router (frozen ones included).
run "$PYTHON" -m mrlx_plugin.cli check --offline "${CHECK_ARGS[@]}"
if [ "$role" = initiator ]; then
  run "$PYTHON" -m mrlx_plugin.cli check --config "$config" --skip-tokenizers
else
  run "$PYTHON" -m mrlx_plugin.cli check --config "$config" --skip-tokenizers --responder
fi

# Where the job's GPUs go. The initiator's engines are only called by its own rollouts, so it
# colocates them with its trainer (slime offloads them while it trains). A responder's engines
# answer the initiator's episodes while the responder trains (the jobs overlap by up to
# max_staleness steps), so a responder must not colocate: its engines keep their own GPUs.
if [ "$role" = initiator ]; then
  placement=(--actor-num-nodes 1 --actor-num-gpus-per-node "$gpus" --colocate)
  ray_gpus="$gpus"
else
  placement=(--actor-num-nodes 1 --actor-num-gpus-per-node "$gpus" --rollout-num-gpus "$rollout_gpus")
  ray_gpus="$((gpus + rollout_gpus))"
fi

# 2. This job's Ray head (on AGENT_<KEY>_CUDA_DEVICES only, when set: GPUs a node shares).
ray_env=()
if [ -n "$(v CUDA_DEVICES)" ]; then ray_env=(env "CUDA_VISIBLE_DEVICES=$(v CUDA_DEVICES)"); fi
run ${ray_env[@]+"${ray_env[@]}"} ray start --head --node-ip-address "$host" --port "$ray_port" --num-gpus "$ray_gpus" \
  --disable-usage-stats --dashboard-host 127.0.0.1 --dashboard-port "$dashboard_port"

# 3. This job's router, at the fixed address the other jobs and the env file know.
start_bg "$log_dir/router" "$PYTHON" -m sglang_router.launch_router --host "$host" --port "$router_port" \
  --log-level warn

# 4. The slime job. The runtime env carries PYTHONPATH and every MRLX_* address the YAML reads.
runtime_env=$("$PYTHON" - <<'PY'
import json, os
env = {k: v for k, v in os.environ.items() if k.startswith(("MRLX_", "AGENT_"))}
env.pop("MRLX_TOKEN", None)  # the token travels as a file (MRLX_TOKEN_FILE), never in a job spec
env["PYTHONPATH"] = ":".join(p for p in (os.environ["MEGATRON_DIR"], os.environ["MRLX_REPO"]) if p)
env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
print(json.dumps({"env_vars": env}))
PY
)

MODEL_ARGS=()
# shellcheck source=/dev/null
[ "${MRLX_DRY_RUN:-0}" = 1 ] || source "$(v MODEL_SCRIPT)"   # slime's own script (code): defines MODEL_ARGS
common=(
  "${placement[@]}"
  --hf-checkpoint "$(v HF)" --ref-load "$(v REF)" --load "$(v SAVE)" --save "$(v SAVE)" --save-interval 20
  --tensor-model-parallel-size "$tp" --sequence-parallel --rollout-num-gpus-per-engine "$gpus_per_engine"
  --sglang-router-ip "$host" --sglang-router-port "$router_port"
  --rollout-function-path "$rollout_fn"
  --custom-generate-function-path mrlx_plugin.rollout.generate
  --custom-reward-post-process-path mrlx_plugin.rollout.normalize
  --custom-rollout-log-function-path mrlx_plugin.rollout.log_rollout
  --custom-config-path "$config"
  --prompt-data "$MRLX_PROMPT_DATA" --input-key prompt --label-key label --rollout-shuffle
  --num-rollout "$num_rollout"
  --rollout-batch-size "$batch" --n-samples-per-prompt "$per_prompt"
  --global-batch-size "$((batch * per_prompt))"
  --rollout-max-context-len "$context_len" --rollout-max-response-len "$response_len"
  --rollout-temperature 1
  --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl
  --eps-clip 0.2 --eps-clip-high 0.28 --use-rollout-logprobs
  --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
  --use-dynamic-batch-size --max-tokens-per-gpu 16384
  --attention-dropout 0.0 --hidden-dropout 0.0 --attention-backend flash
)
submit=(ray job submit --address "http://127.0.0.1:$dashboard_port" --runtime-env-json "$runtime_env")
[ "${MRLX_WAIT:-1}" = 1 ] || submit+=(--no-wait)
# Ray joins the job's words into one line and runs it with /bin/sh: each word is quoted for it.
entrypoint=()
for word in "$PYTHON" "$SLIME_DIR/train.py" ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} "${common[@]}"; do
  ray_word "$word"
  entrypoint+=("$RAY_WORD")
done
run "${submit[@]}" -- "${entrypoint[@]}"
