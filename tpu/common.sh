# shellcheck shell=bash
# Shared by every tpu/*.sh (sourced, never run): option helpers, validation, run-or-print,
# the gcloud calls they all make, and the queued-resource state reader.
#
# Conventions every script follows:
#   - options are "--opt value" or "--opt=value"; --name/--zone/--project default to
#     $TPU_NAME/$TPU_ZONE/$TPU_PROJECT;
#   - a bad argument prints ONE line "SCRIPT: error: ..." on stderr and exits 2; a failure at
#     run time (workers disagree, job failed) exits 1;
#   - --dry-run prints each command it would run, one per line, shell-quoted, on stdout, and
#     runs nothing; progress notes go to stderr.
#
# The globals below are read by the scripts that source this file.
# shellcheck disable=SC2034

SCRIPT=$(basename "$0")
TPU_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$TPU_DIR/.." && pwd)
GCLOUD=${GCLOUD:-gcloud}

NAME=${TPU_NAME:-}
ZONE=${TPU_ZONE:-}
PROJECT=${TPU_PROJECT:-}
DRY_RUN=0
LOC=()

# Paths on the workers. "$HOME" is left for the worker's shell to expand.
# shellcheck disable=SC2016
REMOTE_HOME='$HOME'
VENV="$REMOTE_HOME/selfrag-jax-venv"
WORKDIR="$REMOTE_HOME/selfrag-jax"
LOG_DIR="$REMOTE_HOME/selfrag-jax-logs"
JOB=job

# Dry-run output goes to the real stdout even from inside $(...).
exec 3>&1

die() { printf '%s: error: %s\n' "$SCRIPT" "$*" >&2; exit 2; }
fail() { printf '%s: %s\n' "$SCRIPT" "$*" >&2; exit 1; }
note() { printf '[%s] %s\n' "$SCRIPT" "$*" >&2; }

# The comment block at the top of the calling script is its --help.
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0; }

# need_value "$@": the option in $1 must be followed by a value.
need_value() { [[ $# -ge 2 && $2 != --* ]] || die "$1 needs a value"; }

# Options every script takes. Sets SHIFT_BY for the caller's loop; dies on anything unknown.
common_option() {
  SHIFT_BY=2
  case $1 in
    --name) need_value "$@"; NAME=$2 ;;
    --zone) need_value "$@"; ZONE=$2 ;;
    --project) need_value "$@"; PROJECT=$2 ;;
    --dry-run) DRY_RUN=1; SHIFT_BY=1 ;;
    -h | --help) usage ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) die "unexpected argument '$1' (see --help)" ;;
  esac
}

# Remote paths and job names end up unquoted in worker shell lines: keep them plain.
check_remote_path() { [[ $2 =~ ^[A-Za-z0-9_./~\$-]+$ ]] || die "$1 '$2': use letters, digits, '_', '.', '/', '-', '~' or \$HOME"; }
check_job_name() { [[ $1 =~ ^[A-Za-z0-9_.-]+$ ]] || die "--job '$1': use letters, digits, '_', '.', '-'"; }
check_count() { [[ $2 =~ ^[0-9]+$ ]] || die "$1 '$2' is not a whole number"; }

# Name, zone and project: every gcloud call names all three, never the gcloud defaults.
require_location() {
  [[ -n $NAME ]] || die "--name is required (or set TPU_NAME)"
  [[ $NAME =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
    die "--name '$NAME': lower-case letters, digits and '-', starting with a letter"
  [[ -n $ZONE ]] || die "--zone is required (or set TPU_ZONE)"
  [[ $ZONE =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || die "--zone '$ZONE' is not a zone such as us-east5-a"
  [[ -n $PROJECT ]] || die "--project is required (or set TPU_PROJECT)"
  [[ $PROJECT =~ ^[a-z][-a-z0-9]{4,28}[a-z0-9]$ ]] || die "--project '$PROJECT' is not a project id"
  LOC=(--zone="$ZONE" --project="$PROJECT")
}

# args_checked: called once a script has validated its arguments. Under TPU_CHECK_ARGS=1 it
# stops there, so retry.sh can check its sub-scripts' arguments before waiting in a queue.
args_checked() { [[ ${TPU_CHECK_ARGS:-0} != 1 ]] || exit 0; }

# quote WORD: WORD as bash would read it back (plain words stay bare, the rest single-quoted).
quote() {
  if [[ $1 =~ ^[-A-Za-z0-9_./:=@%+,]+$ ]]; then
    printf '%s' "$1"
  else
    local q="'\\''"
    printf "'%s'" "${1//\'/$q}"
  fi
}

# quote_all WORD...: the words joined into one shell line.
quote_all() {
  local out=() word
  for word in "$@"; do out+=("$(quote "$word")"); done
  printf '%s' "${out[*]}"
}

# run CMD...: run it, or under --dry-run print it.
run() {
  if ((DRY_RUN)); then
    printf '%s\n' "$(quote_all "$@")" >&3
  else
    "$@"
  fi
}

# remote_script PRELUDE... <<'EOF': one worker shell line from the arguments and the heredoc
# (dry runs print one command per line). Each heredoc line must be a complete command;
# comments and blank lines are dropped; lines are joined with ';' (after a trailing '&',
# which already ends a command, with a space).
remote_script() {
  local joined="" line
  for line in "$@"; do joined+="$line; "; done
  while IFS= read -r line; do
    [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
    if [[ $line == *'&' ]]; then joined+="$line "; else joined+="$line; "; fi
  done
  printf '%s' "${joined%; }"
}

# ssh_all COMMAND: run a shell line on every worker at once. A multi-host job must start on
# all workers together: started on one, it waits forever for the others.
ssh_all() {
  run "$GCLOUD" compute tpus tpu-vm ssh "$NAME" "${LOC[@]}" --worker=all --command="$1"
}

# Fake queued-resource states for --dry-run tests: a file with one "STATE [JOB]" per line,
# read one line per poll (JOB: running, succeeded or failed).
FAKE_STATES=()
FAKE_AT=0
load_fake_states() {
  [[ -f $1 ]] || die "--fake-states '$1' is not a file"
  mapfile -t FAKE_STATES < <(grep -v '^[[:space:]]*$' "$1")
  ((${#FAKE_STATES[@]})) || die "--fake-states '$1' is empty"
}

# poll_qr QR_ID: sets STATE (a QueuedResource state, or NOT_FOUND) and FAKE_JOB.
poll_qr() {
  local describe=("$GCLOUD" compute tpus queued-resources describe "$1" "${LOC[@]}"
    --format='value(state.state)')
  FAKE_JOB=running
  if ((DRY_RUN)); then
    run "${describe[@]}"
    ((FAKE_AT < ${#FAKE_STATES[@]})) || fail "fake states ran out after ${#FAKE_STATES[@]} polls"
    read -r STATE FAKE_JOB <<<"${FAKE_STATES[FAKE_AT]}"
    FAKE_JOB=${FAKE_JOB:-running}
    FAKE_AT=$((FAKE_AT + 1))
  else
    # describe fails when the queued resource does not exist (never created, or deleted).
    STATE=$("${describe[@]}" 2>/dev/null) || STATE=NOT_FOUND
    STATE=${STATE:-NOT_FOUND}
  fi
  note "queued resource $1: $STATE"
}

# pause SECONDS: sleep between polls; a dry run only says so.
pause() { if ((DRY_RUN)); then note "(would sleep $1 s)"; else sleep "$1"; fi; }
