# shellcheck shell=bash
# The env file and the agents of a run as it lists them; sourced by the launch scripts (not run).
#
# An env file is data, read by read_env_file (never sourced): each setting is a line
#   : "${NAME:=VALUE}"          # a comment
# which sets NAME to VALUE unless the environment already gives NAME a value. In VALUE, $NAME and
# ${NAME} are the value of a variable set above (or in the environment); nothing else is expanded
# or run. The same file can still be sourced by bash, with the same meaning.
#
# MRLX_AGENTS lists a key per agent ("debater_a debater_b judge"). A key's variables are
# AGENT_<KEY>_* with the key in upper case (AGENT_DEBATER_A_CONFIG); AGENT_<KEY> is the agent's
# name in the YAML (default: the key) and AGENT_<KEY>_ROLE what runs it:
#   initiator  its slime job runs every episode (exactly one agent)
#   responder  its slime job trains on its part of the initiator's episodes
#   frozen     no trainer: SGLang servers and a router only (serve_frozen.sh)
# Without MRLX_AGENTS the keys are A (initiator) and B (responder), as in two-model env files.
#
# Every value is used as data: numbers are checked to be whole numbers in range before any
# arithmetic (bash evaluates `PATH[$(cmd)]` in arithmetic, running cmd), words are passed as
# arguments, and the job handed to `ray job submit` is quoted for the shell that runs it
# (ray_word). The model script (AGENT_<KEY>_MODEL_SCRIPT) is slime's, and sourced: it is code.

# Print the words of a command for a shell to read back (MRLX_DRY_RUN=1): a word of only safe
# characters as it is, any other in single quotes (POSIX: any sh reads it, and Python's shlex).
sh_words() {
  local word sep=""
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_./:,+@%-]+$ ]]; then printf '%s%s' "$sep" "$word"
    else printf "%s'%s'" "$sep" "${word//\'/\'\\\'\'}"; fi
    sep=" "
  done
  echo
}

# RAY_WORD: $1 as one word of the entrypoint of `ray job submit`. Ray joins the entrypoint's words
# with Python's subprocess.list2cmdline and runs the line with /bin/sh; list2cmdline wraps a word
# with a space or tab in double quotes and writes each " as \", so the word is quoted for sh in
# the way that survives that: without a blank, single-quoted with each " outside the quotes (sh
# reads list2cmdline's \" there as "); with one, escaped for sh's double quotes ($ ` \), leaving
# the backslashes before a " or at the end, which list2cmdline doubles itself, single.
# shellcheck disable=SC2034
ray_word() {
  local s="$1" out="" c i n pad
  if [[ $s =~ ^[A-Za-z0-9_./:,+@%-]+$ ]]; then RAY_WORD="$s"; return; fi
  if [[ $s != *[[:blank:]]* ]]; then
    s="${s//\'/\'\\\'\'}"
    RAY_WORD="'${s//\"/\'\"\'}'"
    return
  fi
  for ((i = 0; i < ${#s}; i++)); do
    c="${s:i:1}"
    if [ "$c" = "\\" ]; then
      n=0
      while [ "${s:i:1}" = "\\" ]; do n=$((n + 1)); i=$((i + 1)); done
      if [ "$i" -lt "${#s}" ] && [ "${s:i:1}" != '"' ]; then n=$((2 * n)); fi
      printf -v pad '%*s' "$n" ''
      out+="${pad// /\\}"
      i=$((i - 1))
    elif [ "$c" = '$' ] || [ "$c" = '`' ]; then
      out+="\\$c"
    else
      out+="$c"
    fi
  done
  RAY_WORD="$out"  # read by the scripts that source this file
}

# An error in the env file (or the environment): the message, then exit 2.
refuse() { echo "$*" >&2; exit 2; }
# A value of an env file ($1 names it) that holds shell ($2): refused, not run.
not_data() { refuse "$1: $2 is not allowed: an env file holds data, not shell; set such a value in the environment"; }

# ENV_VALUE: $1 with each $NAME and ${NAME} replaced by that variable's value; $2 names the place.
expand_env_value() {
  local rest="$1" where="$2" out="" lit ref
  # shellcheck disable=SC2016  # a '$' of the value, not an expansion
  local re='^([^$]*)\$(\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))(.*)$'
  while true; do
    lit="${rest%%\$*}"  # the text before the next '$'
    case "$lit" in
      *'`'*) not_data "$where" "'\`'" ;;
      *\\*) not_data "$where" "'\\'" ;;
      *\'*) not_data "$where" "\"'\"" ;;
      *'}'*) not_data "$where" "'}' outside \${NAME}" ;;
    esac
    if [[ $rest != *'$'* ]]; then ENV_VALUE="$out$rest"; return; fi
    if ! [[ $rest =~ $re ]]; then
      case "$rest" in
        *"\$("*) not_data "$where" "'\$('" ;;
        *) not_data "$where" "a '\$' that is neither \$NAME nor \${NAME}" ;;
      esac
    fi
    ref="${BASH_REMATCH[3]:-${BASH_REMATCH[4]}}"
    [ -n "${!ref+set}" ] || refuse "$where: \$$ref is not set (set it above this line, or in the environment)"
    out+="$lit${!ref}"
    rest="${BASH_REMATCH[5]}"
  done
}

# Read env file $1 as data (see the top of this file), exporting every variable it names, and
# MRLX_REPO (default: the repository of these scripts). Any other line: exit 2, naming it.
read_env_file() {
  local file="$1" line n=0 name value
  local setting='^[[:space:]]*:[[:space:]]+"\$\{([A-Za-z_][A-Za-z0-9_]*):=([^"]*)\}"[[:space:]]*(#.*)?$'
  # A default with quotes in it (MRLX_REPO's, for a shell that sources the file) is never read
  # here: the variable is set before (this reader sets MRLX_REPO itself), or the line is refused.
  local quoted='^[[:space:]]*:[[:space:]]+"\$\{([A-Za-z_][A-Za-z0-9_]*):=(.*)\}"[[:space:]]*(#.*)?$'
  local skip='^[[:space:]]*((#.*)?|set[[:space:]]+[-+]a[[:space:]]*(#.*)?)$'
  if ! [ -f "$file" ] || ! [ -r "$file" ]; then refuse "env file $file: not a file this user can read"; fi
  : "${MRLX_REPO:=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)}"
  export MRLX_REPO
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    if [[ $line =~ $skip ]]; then continue; fi
    if [[ $line =~ $setting ]] || [[ $line =~ $quoted ]]; then
      name="${BASH_REMATCH[1]}" value="${BASH_REMATCH[2]}"
    else
      refuse "$file, line $n: not a setting; write each as : \"\${NAME:=VALUE}\" (an env file is data, not run)"
    fi
    # Only the launch's own names: BASH_ENV, LD_PRELOAD, PATH and their kind would change how
    # every later program runs, which data may not do.
    case "$name" in
      MRLX_* | AGENT_* | SLIME_DIR | MEGATRON_DIR | PYTHON) ;;
      *) refuse "$file, line $n: $name is not a launch setting (MRLX_*, AGENT_*, SLIME_DIR, MEGATRON_DIR," \
           "PYTHON); a variable that changes how programs run (BASH_ENV, LD_PRELOAD, PATH, ...) belongs in" \
           "the environment, not in an env file" ;;
    esac
    # As `source` would: a variable the environment (or a line above) already set keeps its value.
    if [ -z "${!name:-}" ]; then
      case "$value" in *'"'*) not_data "$file, line $n: $name" "'\"'" ;; esac
      expand_env_value "$value" "$file, line $n: $name"
      printf -v "$name" '%s' "$ENV_VALUE"
    fi
    export "${name?}"
  done < "$file"
  : "${MRLX_AGENTS:=A B}"
  export MRLX_AGENTS
}

agent_prefix() { printf 'AGENT_%s' "$(printf '%s' "$1" | tr '[:lower:]-' '[:upper:]_')"; }
agent_var() { local name; name="$(agent_prefix "$1")_$2"; printf '%s' "${!name:-}"; }
agent_name() { local name; name="$(agent_prefix "$1")"; printf '%s' "${!name:-$1}"; }

# Variable $1's value (or $4 when it is unset or empty) when it is a whole number from $2 to $3;
# else exit 2 naming the variable. Assign it (x="$(int_var ...)") so that set -e sees the exit.
int_var() {
  local name="$1" lo="$2" hi="$3" value="${!1:-${4:-}}"
  if ! [[ $value =~ ^(0|[1-9][0-9]{0,9})$ ]] || ((value < lo || value > hi)); then
    refuse "$name is '$value'; expected a whole number from $lo to $hi"
  fi
  printf '%s' "$value"
}

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

# Exit 2 unless $1 (a script's KEY argument) is an agent of MRLX_AGENTS (after require_agents).
require_key() {
  case " $MRLX_AGENTS " in
    *" $1 "*) [[ $1 =~ ^[A-Za-z0-9][A-Za-z0-9_-]*$ ]] && return ;;
  esac
  refuse "$(basename -- "$0"): '$1' is not in MRLX_AGENTS ($MRLX_AGENTS)"
}

# Refuse an env file whose agents cannot make a run (exit 2, naming the variable to fix); then
# CHECK_ARGS holds `--config FILE --role ROLE` for every trained agent (for `mrlx check`) and
# TRAINED_NAMES their names, comma-separated (for the coordinator).
require_agents() {
  local key role name initiators=0 keys
  read -r -a keys <<< "$MRLX_AGENTS"  # no glob: the keys are checked before any use
  for key in ${keys[@]+"${keys[@]}"}; do
    # A key makes variable names (AGENT_<KEY>_*), and bash evaluates a subscript in one
    [[ $key =~ ^[A-Za-z0-9][A-Za-z0-9_-]*$ ]] \
      || refuse "MRLX_AGENTS has '$key'; an agent's key is letters, digits, '_' and '-'"
    name="$(agent_name "$key")"
    [[ $name =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]*$ ]] \
      || refuse "$(agent_prefix "$key") is '$name'; an agent's name is letters, digits, '_', '-' and '.'"
  done
  CHECK_ARGS=(); TRAINED_NAMES=""
  for key in ${keys[@]+"${keys[@]}"}; do
    role="$(agent_role "$key")"
    case "$role" in
      initiator|responder)
        [ "$role" = initiator ] && initiators=$((initiators + 1))
        if [ -z "$(agent_var "$key" CONFIG)" ]; then
          refuse "$(agent_prefix "$key")_CONFIG is not set: a trained agent's slime job needs its YAML"
        fi
        CHECK_ARGS+=(--config "$(agent_var "$key" CONFIG)" --role "$role")
        TRAINED_NAMES="${TRAINED_NAMES:+$TRAINED_NAMES,}$(agent_name "$key")" ;;
      frozen)
        if [ -z "$(agent_var "$key" HF)" ]; then
          refuse "$(agent_prefix "$key")_HF is not set: a frozen agent's servers need its model"
        fi ;;
      *) refuse "$(agent_prefix "$key")_ROLE is '$role'; expected initiator, responder or frozen" ;;
    esac
  done
  if [ "$initiators" != 1 ]; then
    refuse "MRLX_AGENTS ($MRLX_AGENTS) has $initiators initiators; exactly one agent's job runs the episodes"
  fi
}

# Print the command (MRLX_DRY_RUN=1) or run it.
run() {
  if [ "${MRLX_DRY_RUN:-0}" = 1 ]; then sh_words "$@"; else "$@"; fi
}

# Start a long-running command in the background, its log and pid in $1.log and $1.pid (or print it).
# nohup, not mrlx_plugin.core.processes: these services (coordinator, servers, router) must outlive
# the script and the terminal that started them, and are stopped later through their pid files.
start_bg() {
  local base="$1"; shift
  if [ "${MRLX_DRY_RUN:-0}" = 1 ]; then sh_words "$@"; return; fi
  nohup "$@" >> "$base.log" 2>&1 &
  echo $! > "$base.pid"
}
