#!/usr/bin/env bash
# Keep a job running on a queued-resource TPU through preemptions, until it finishes.
#
# Polls the queued resource. When it is ACTIVE: install, clean up and launch the job on all
# workers (install.sh, launch.sh), then watch the job. When it was preempted (SUSPENDED,
# PREEMPTED), failed or disappeared: delete it, queue it again, and relaunch the same command
# once it is back. The relaunched job resumes from its last Orbax checkpoint, so checkpoints
# must live off the VM (a gs:// output dir): the new VM starts with an empty disk.
#
# Usage: tpu/retry.sh --name NAME --zone ZONE --project PROJECT --type TYPE [options] \
#          -- selfrag-jax SUBCOMMAND [ARGS...]
#   --max-retries N      recreations before giving up (default 10)
#   --poll SECONDS       between state polls (default 60)
#   --prepare LINE       shell line run on all workers of each new VM before the launch
#                        (e.g. mounting the bucket that holds data and outputs)
#   --fake-states FILE   with --dry-run: one "STATE [JOB]" per poll, JOB = running (default),
#                        succeeded or failed; without it a dry run shows a clean first run
#   --dry-run            print the gcloud commands instead of running them
# Passed to create.sh: --type --runtime --spot --best-effort --valid-until --qr
# Passed to install.sh: --wheel --ref --extras --no-deps-pkg --python --expect-workers --skip-check
# Passed to launch.sh: --job --env;  to both: --venv --workdir;  to launch.sh: --log-dir
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

CREATE=()
INSTALL=()
LAUNCH=()
QR=""
MAX_RETRIES=10
POLL=60
FAKE_FILE=""
PREPARE=""
while (($#)); do
  case $1 in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac
  case $1 in
    --type | --runtime | --valid-until) need_value "$@"; CREATE+=("$1=$2"); shift 2 ;;
    --spot | --best-effort) CREATE+=("$1"); shift ;;
    --qr) need_value "$@"; QR=$2; shift 2 ;;
    --wheel | --ref | --extras | --no-deps-pkg | --python | --expect-workers)
      need_value "$@"; INSTALL+=("$1=$2"); shift 2 ;;
    --skip-check) INSTALL+=("$1"); shift ;;
    --job | --env | --log-dir) need_value "$@"; LAUNCH+=("$1=$2"); shift 2 ;;
    --venv | --workdir) need_value "$@"; INSTALL+=("$1=$2"); LAUNCH+=("$1=$2"); shift 2 ;;
    --max-retries) need_value "$@"; MAX_RETRIES=$2; shift 2 ;;
    --poll) need_value "$@"; POLL=$2; shift 2 ;;
    --prepare) need_value "$@"; PREPARE=$2; shift 2 ;;
    --fake-states) need_value "$@"; FAKE_FILE=$2; shift 2 ;;
    --) shift; break ;;
    *) common_option "$@"; shift "$SHIFT_BY" ;;
  esac
done
require_location
check_count --max-retries "$MAX_RETRIES"
check_count --poll "$POLL"
(($#)) || die "no job given: add -- selfrag-jax SUBCOMMAND [ARGS...]"
JOB_ARGS=("$@")
QR=${QR:-$NAME-qr}
if [[ -n $FAKE_FILE ]]; then
  ((DRY_RUN)) || die "--fake-states only works with --dry-run"
  load_fake_states "$FAKE_FILE"
elif ((DRY_RUN)); then
  FAKE_STATES=(NOT_FOUND ACTIVE "ACTIVE succeeded")
fi

location=(--name="$NAME" "${LOC[@]}")
dry=()
((DRY_RUN)) && dry=(--dry-run)
create() { "$TPU_DIR/create.sh" "${location[@]}" --qr="$QR" "${CREATE[@]}" "${dry[@]}"; }
install() { "$TPU_DIR/install.sh" "${location[@]}" "${INSTALL[@]}" "${dry[@]}"; }
prepare() { [[ -z $PREPARE ]] || "$TPU_DIR/exec.sh" "${location[@]}" "${dry[@]}" -- bash -c "$PREPARE"; }
launch() { "$TPU_DIR/launch.sh" "${location[@]}" "${LAUNCH[@]}" "${dry[@]}" -- "${JOB_ARGS[@]}"; }

# Check every argument now, not after hours in the queue.
TPU_CHECK_ARGS=1 create
TPU_CHECK_ARGS=1 install
TPU_CHECK_ARGS=1 launch
JOB=${JOB_ARGS[1]}
for arg in "${LAUNCH[@]}"; do [[ $arg == --job=* ]] && JOB=${arg#--job=}; done
for arg in "${LAUNCH[@]}"; do [[ $arg == --log-dir=* ]] && LOG_DIR=${arg#--log-dir=}; done
[[ ${JOB_ARGS[1]} != train || " ${JOB_ARGS[*]}" == *gs://* ]] ||
  note "warning: no gs:// path in the train command: checkpoints on the VM's disk die with it"

# job_status: sets JOB_STATUS to running, succeeded or failed from every worker's JOB.exit.
job_status() {
  local script output codes
  script=$(remote_script "log_dir=$LOG_DIR" <<EOF
echo "JOB_EXIT \$(cat "\$log_dir/$JOB.exit" 2>/dev/null || echo running)"
EOF
  )
  if ((DRY_RUN)); then
    ssh_all "$script"
    JOB_STATUS=$FAKE_JOB
  elif ! output=$(ssh_all "$script" 2>&1); then
    JOB_STATUS=running # a worker is unreachable: the next state poll says why
  else
    codes=$(sed -n 's/.*JOB_EXIT //p' <<<"$output")
    if grep -qvE '^(0|running)$' <<<"$codes"; then
      JOB_STATUS=failed
    elif [[ -n $codes ]] && ! grep -q running <<<"$codes"; then
      JOB_STATUS=succeeded
    else
      JOB_STATUS=running
    fi
  fi
  note "job $JOB: $JOB_STATUS"
}

recreations=0
launched=0
while true; do
  poll_qr "$QR"
  if [[ $STATE == ACTIVE ]] && ((launched)); then
    job_status
    case $JOB_STATUS in
      succeeded) note "job $JOB finished on all workers"; exit 0 ;;
      running) pause "$POLL"; continue ;;
      failed)
        # A host lost to preemption fails the job before the queued resource says so: look
        # once more before calling it the job's own failure.
        pause "$POLL"
        poll_qr "$QR"
        [[ $STATE != ACTIVE ]] ||
          fail "job $JOB failed on a healthy slice, not retrying: tpu/logs.sh ${location[*]} --job=$JOB"
        ;;
    esac
  fi
  case $STATE in
    ACTIVE)
      install
      prepare
      launch
      launched=1
      pause "$POLL"
      ;;
    SUSPENDED | PREEMPTED | FAILED | NOT_FOUND)
      # The first creation of a missing resource is not a retry; anything after that is.
      if [[ $STATE != NOT_FOUND ]] || ((launched)); then
        ((recreations < MAX_RETRIES)) || fail "gave up after $MAX_RETRIES recreations of $QR (now $STATE)"
        recreations=$((recreations + 1))
        note "recreating $QR ($recreations/$MAX_RETRIES)"
      fi
      # --force also deletes the preempted VM; a queued resource id is reusable once deleted.
      [[ $STATE == NOT_FOUND ]] || "$TPU_DIR/delete.sh" "${location[@]}" --qr="$QR" "${dry[@]}"
      create
      launched=0
      pause "$POLL"
      ;;
    *) pause "$POLL" ;; # queued, provisioning, suspending or deleting: wait
  esac
done
