#!/usr/bin/env bash
# Show or stream a job's log from the workers, each line tagged with its worker's hostname.
#
# Usage: tpu/logs.sh --name NAME --zone ZONE --project PROJECT [options]
#   --job NAME       which job (default: the newest log on each worker)
#   --worker W       all (default) or one worker number; reading one worker is safe
#   --lines N        lines of history to show first (default 100)
#   --follow         keep streaming (Ctrl-C stops the stream, not the job)
#   --log-dir DIR    default $HOME/selfrag-jax-logs
#   --dry-run        print the gcloud command instead of running it
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

JOB=""
WORKER=all
LINES=100
FOLLOW=0
while (($#)); do
  case $1 in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac
  case $1 in
    --job) need_value "$@"; JOB=$2; shift 2 ;;
    --worker) need_value "$@"; WORKER=$2; shift 2 ;;
    --lines) need_value "$@"; LINES=$2; shift 2 ;;
    --follow | -f) FOLLOW=1; shift ;;
    --log-dir) need_value "$@"; LOG_DIR=$2; shift 2 ;;
    *) common_option "$@"; shift "$SHIFT_BY" ;;
  esac
done
require_location
[[ -z $JOB ]] || check_job_name "$JOB"
[[ $WORKER == all || $WORKER =~ ^[0-9]+$ ]] || die "--worker '$WORKER' must be 'all' or a worker number"
check_count --lines "$LINES"
check_remote_path --log-dir "$LOG_DIR"

# -F follows the file across the job's restarts (launch.sh truncates it).
tail_opts="-n $LINES"
((FOLLOW)) && tail_opts+=" -F"
if [[ -n $JOB ]]; then
  pick="log=\"\$log_dir/$JOB.log\""
else
  pick="log=\$(ls -t \"\$log_dir\"/*.log 2>/dev/null | head -n 1)"
fi
script=$(remote_script "log_dir=$LOG_DIR" "$pick" <<EOF
[ -n "\$log" ] || { echo "\$(hostname): no log in \$log_dir"; exit 1; }
tail $tail_opts "\$log" | sed -u "s/^/[\$(hostname)] /"
EOF
)
run "$GCLOUD" compute tpus tpu-vm ssh "$NAME" "${LOC[@]}" --worker="$WORKER" --command="$script"
