#!/usr/bin/env bash
# Train Qwen3-30B-A3B as a solver -> rewriter -> selector math team with slime and mrlx_plugin.
#
# Run from the slime checkout on the head node (8 GPUs), with mrlx_plugin pip-installed in the
# image or its repository on PYTHONPATH. Paths default to slime's usual layout; override them
# through the environment, e.g.  MODEL_DIR=/data/Qwen3-30B-A3B bash run-qwen3-30B-A3B-multi-agent.sh
set -euo pipefail

SLIME_DIR=${SLIME_DIR:-/root/slime}
MODEL_DIR=${MODEL_DIR:-/root/Qwen3-30B-A3B}
REF_DIR=${REF_DIR:-/root/Qwen3-30B-A3B_torch_dist}
SAVE_DIR=${SAVE_DIR:-/root/Qwen3-30B-A3B_mrlx}
DATA=${DATA:-/root/dapo-math-17k/dapo-math-17k.jsonl}
MRLX_REPO=${MRLX_REPO:-$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd)}
MRLX_CONFIG=${MRLX_CONFIG:-$MRLX_REPO/examples/multi_agent/math_team.yaml}
NUM_GPUS=${NUM_GPUS:-8}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}

export PYTHONUNBUFFERED=1

# Validate the plugin settings (and import the hook modules) before any GPU is touched.
PYTHONPATH="$MRLX_REPO:${PYTHONPATH:-}" python3 -m mrlx_plugin.cli check --config "$MRLX_CONFIG" --skip-tokenizers

source "$SLIME_DIR/scripts/models/qwen3-30B-A3B.sh"   # defines MODEL_ARGS

CKPT_ARGS=(
  --hf-checkpoint "$MODEL_DIR"
  --ref-load "$REF_DIR"
  --load "$SAVE_DIR"
  --save "$SAVE_DIR"
  --save-interval 20
)

ROLLOUT_ARGS=(
  # mrlx_plugin: one function per flag, settings in the YAML.
  --custom-generate-function-path mrlx_plugin.rollout.generate
  --custom-reward-post-process-path mrlx_plugin.rollout.normalize
  --custom-rollout-log-function-path mrlx_plugin.rollout.log_rollout
  --custom-eval-rollout-log-function-path mrlx_plugin.rollout.log_eval_rollout
  --custom-config-path "$MRLX_CONFIG"

  # dapo-math-17k: prompts are chat messages; mrlx renders each role's own template, so no
  # --apply-chat-template here.
  --prompt-data "$DATA"
  --input-key prompt
  --label-key label
  --rollout-shuffle
  --num-rollout 3000
  --rollout-batch-size 32
  --n-samples-per-prompt 8
  --rollout-max-context-len 16384
  --rollout-max-response-len 8192
  --rollout-temperature 1

  # Each input yields exactly 2*num_parallel+1 samples sharing one rollout id (ABORTED fillers
  # for an episode that ends early); the global batch counts rollout ids, so 32 prompts x 8
  # samples = 256 episodes (2,816 samples) per step. The dynamic micro-batches below split any
  # such step; with fixed ones (--micro-batch-size) the plugin checks at start-up that it splits.
  --global-batch-size 256
  --balance-data
)

EVAL_ARGS=(
  --eval-interval 20
  --eval-prompt-data aime /root/aime-2024/aime-2024.jsonl
  --n-samples-per-eval-prompt 16
  --eval-max-response-len 16384
  --eval-top-p 1
)

PERF_ARGS=(
  --tensor-model-parallel-size 4
  --sequence-parallel
  --pipeline-model-parallel-size 1
  --context-parallel-size 1
  --expert-model-parallel-size 8
  --expert-tensor-parallel-size 1
  --recompute-granularity full
  --recompute-method uniform
  --recompute-num-layers 1
  --use-dynamic-batch-size
  --max-tokens-per-gpu 20480
)

GRPO_ARGS=(
  --advantage-estimator grpo
  --use-kl-loss
  --kl-loss-coef 0.00
  --kl-loss-type low_var_kl
  --entropy-coef 0.00
  --eps-clip 0.2
  --eps-clip-high 0.28
  --use-rollout-logprobs
)

OPTIMIZER_ARGS=(
  --optimizer adam
  --lr 1e-6
  --lr-decay-style constant
  --weight-decay 0.1
  --adam-beta1 0.9
  --adam-beta2 0.98
  --optimizer-cpu-offload
  --overlap-cpu-optimizer-d2h-h2d
  --use-precision-aware-optimizer
)

SGLANG_ARGS=(
  --rollout-num-gpus-per-engine 8
  --sglang-mem-fraction-static 0.7
)

MISC_ARGS=(
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --accumulate-allreduce-grads-in-fp32
  --attention-softmax-in-fp32
  --attention-backend flash
)

ray start --head --node-ip-address "$MASTER_ADDR" --num-gpus "$NUM_GPUS" --disable-usage-stats \
  --dashboard-host=127.0.0.1 --dashboard-port="$RAY_DASHBOARD_PORT"

RUNTIME_ENV_JSON=$(printf '{"env_vars": {"PYTHONPATH": "/root/Megatron-LM/:%s", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}}' "$MRLX_REPO")

ray job submit --address="http://127.0.0.1:$RAY_DASHBOARD_PORT" \
  --runtime-env-json="$RUNTIME_ENV_JSON" \
  -- python3 "$SLIME_DIR/train.py" \
  --actor-num-nodes 1 \
  --actor-num-gpus-per-node "$NUM_GPUS" \
  --colocate \
  "${MODEL_ARGS[@]}" \
  "${CKPT_ARGS[@]}" \
  "${ROLLOUT_ARGS[@]}" \
  "${EVAL_ARGS[@]}" \
  "${OPTIMIZER_ARGS[@]}" \
  "${GRPO_ARGS[@]}" \
  "${PERF_ARGS[@]}" \
  "${SGLANG_ARGS[@]}" \
  "${MISC_ARGS[@]}"
