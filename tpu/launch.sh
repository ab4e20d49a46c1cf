#!/usr/bin/env bash
# Start a selfrag-jax job on ALL workers at once, detached, logging on each worker.
# A multi-host job started on one worker waits forever for the others, so there is no option
# to pick workers here. Stale processes and TPU locks are cleared first (cleanup.sh).
#
# Usage: tpu/launch.sh --name NAME --zone ZONE --project PROJECT [options] -- selfrag-jax SUBCOMMAND [ARGS...]
#   SUBCOMMAND           train, generate, sweep, index, plan, eval, annotate or compare
#   --job NAME           names the log, pid and exit files (default: the subcommand)
#   --env KEY=VALUE      set in the job's environment (repeatable)
#   --venv DIR           the workers' virtualenv (default $HOME/selfrag-jax-venv)
#   --workdir DIR        where the job runs (default $HOME/selfrag-jax, the unpacked repo)
#   --log-dir DIR        where JOB.log, JOB.pid and JOB.exit go (default $HOME/selfrag-jax-logs)
#   --no-cleanup         do not run cleanup.sh first
#   --follow             stream the logs afterwards (logs.sh --follow)
#   --dry-run            print the gcloud commands instead of running them
# Example: tpu/launch.sh --name gen --zone us-east5-a --project my-proj -- \
#            selfrag-jax train configs/tpu/generator_7b_v5p-32.yaml run_dir=/gcs/my-bucket/gen
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

JOB=""
ENVS=()
CLEANUP=1
FOLLOW=0
while (($#)); do
  case $1 in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac
  case $1 in
    --job) need_value "$@"; JOB=$2; shift 2 ;;
    --env) need_value "$@"; ENVS+=("$2"); shift 2 ;;
    --venv) need_value "$@"; VENV=$2; shift 2 ;;
    --workdir) need_value "$@"; WORKDIR=$2; shift 2 ;;
    --log-dir) need_value "$@"; LOG_DIR=$2; shift 2 ;;
    --no-cleanup) CLEANUP=0; shift ;;
    --follow) FOLLOW=1; shift ;;
    --) shift; break ;;
    *) common_option "$@"; shift "$SHIFT_BY" ;;
  esac
done
require_location
subcommands="train generate sweep index plan eval annotate compare"
(($#)) || die "no job given: add -- selfrag-jax SUBCOMMAND [ARGS...]"
[[ $1 == selfrag-jax ]] || die "the job must start with selfrag-jax, not '$1'"
[[ " $subcommands " == *" ${2:-} "* ]] || die "unknown selfrag-jax subcommand '${2:-}' (one of: $subcommands)"
JOB=${JOB:-$2}
check_job_name "$JOB"
check_remote_path --venv "$VENV"
check_remote_path --workdir "$WORKDIR"
check_remote_path --log-dir "$LOG_DIR"
for kv in "${ENVS[@]}"; do
  [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env '$kv' is not KEY=VALUE"
done
job=("$@")
((${#ENVS[@]})) && job=(env "${ENVS[@]}" "$@")
args_checked

dry=()
((DRY_RUN)) && dry=(--dry-run)
location=(--name="$NAME" "${LOC[@]}")
((CLEANUP)) && "$TPU_DIR/cleanup.sh" "${location[@]}" --log-dir="$LOG_DIR" "${dry[@]}"

# Runs on each worker (the quoted heredoc is the worker's shell code). setsid gives the job its
# own process group, which cleanup.sh stops as a whole; nohup and the redirections let it
# outlive this ssh session; its exit status lands in JOB.exit, which retry.sh reads.
script=$(remote_script "set -e" "log_dir=$LOG_DIR" "job=$JOB" "workdir=$WORKDIR" "venv=$VENV" \
  "cmd=$(quote "$(quote_all "${job[@]}")")" <<'EOF'
mkdir -p "$log_dir"
rm -f "$log_dir/$job.exit"
cd "$workdir"
setsid nohup bash -c "export PATH=\"$venv/bin:\$PATH\"; $cmd; echo \$? > \"$log_dir/$job.exit\"" > "$log_dir/$job.log" 2>&1 < /dev/null &
echo $! > "$log_dir/$job.pid"
echo "$(hostname): started $job"
EOF
)
ssh_all "$script"
note "started '$JOB' on all workers; logs: tpu/logs.sh ${location[*]} --job=$JOB --follow"

((FOLLOW)) || exit 0
exec "$TPU_DIR/logs.sh" "${location[@]}" --log-dir="$LOG_DIR" --job="$JOB" --follow "${dry[@]}"
