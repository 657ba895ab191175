# The agents of a run as the env file lists them; sourced by the launch scripts (not run).
#
# MRLX_AGENTS lists a key per agent ("debater_a debater_b judge"). A key's variables are
# AGENT_<KEY>_* with the key in upper case (AGENT_DEBATER_A_CONFIG); AGENT_<KEY> is the agent's
# name in the YAML (default: the key) and AGENT_<KEY>_ROLE what runs it:
#   initiator  its slime job runs every episode (exactly one agent)
#   responder  its slime job trains on its part of the initiator's episodes
#   frozen     no trainer: SGLang servers and a router only (serve_frozen.sh)
# Without MRLX_AGENTS the keys are A (initiator) and B (responder), as in two-model env files.
: "${MRLX_AGENTS:=A B}"

agent_prefix() { printf 'AGENT_%s' "$(printf '%s' "$1" | tr '[:lower:]-' '[:upper:]_')"; }
agent_var() { local name; name="$(agent_prefix "$1")_$2"; printf '%s' "${!name:-}"; }
agent_name() { local name; name="$(agent_prefix "$1")"; printf '%s' "${!name:-$1}"; }

agent_role() {
  local role; role="$(agent_var "$1" ROLE)"
  if [ -z "$role" ]; then
    case "$1" in A) role=initiator ;; B) role=responder ;; esac
  fi
  printf '%s' "$role"
}

# The URL of the agent's router: MRLX_URL_<KEY> when the env file sets it, else its host and port.
agent_url() {
  local name; name="MRLX_URL_$(agent_prefix "$1" | cut -c7-)"
  if [ -n "${!name:-}" ]; then printf '%s' "${!name}"
  else printf 'http://%s:%s' "$(agent_var "$1" HOST)" "$(agent_var "$1" ROUTER_PORT)"; fi
}

agents_with_role() {
  local key
  for key in $MRLX_AGENTS; do
    if [ "$(agent_role "$key")" = "$1" ]; then printf '%s\n' "$key"; fi
  done
}

# Refuse an env file whose agents cannot make a run (exit 2, naming the variable to fix); then
# CHECK_ARGS holds `--config FILE --role ROLE` for every trained agent (for `mrlx check`) and
# TRAINED_NAMES their names, comma-separated (for the coordinator).
require_agents() {
  local key role initiators=0
  CHECK_ARGS=(); TRAINED_NAMES=""
  for key in $MRLX_AGENTS; do
    role="$(agent_role "$key")"
    case "$role" in
      initiator|responder)
        [ "$role" = initiator ] && initiators=$((initiators + 1))
        if [ -z "$(agent_var "$key" CONFIG)" ]; then
          echo "$(agent_prefix "$key")_CONFIG is not set: a trained agent's slime job needs its YAML" >&2; exit 2
        fi
        CHECK_ARGS+=(--config "$(agent_var "$key" CONFIG)" --role "$role")
        TRAINED_NAMES="${TRAINED_NAMES:+$TRAINED_NAMES,}$(agent_name "$key")" ;;
      frozen)
        if [ -z "$(agent_var "$key" HF)" ]; then
          echo "$(agent_prefix "$key")_HF is not set: a frozen agent's servers need its model" >&2; exit 2
        fi ;;
      *) echo "$(agent_prefix "$key")_ROLE is '$role'; expected initiator, responder or frozen" >&2; exit 2 ;;
    esac
  done
  if [ "$initiators" != 1 ]; then
    echo "MRLX_AGENTS ($MRLX_AGENTS) has $initiators initiators; exactly one agent's job runs the episodes" >&2; exit 2
  fi
}

# Print the command (MRLX_DRY_RUN=1) or run it.
run() {
  if [ "${MRLX_DRY_RUN:-0}" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

# Start a long-running command in the background, its log and pid in $1.log and $1.pid (or print it).
start_bg() {
  local base="$1"; shift
  if [ "${MRLX_DRY_RUN:-0}" = 1 ]; then printf '%q ' "$@"; echo; return; fi
  nohup "$@" >> "$base.log" 2>&1 &
  echo $! > "$base.pid"
}
