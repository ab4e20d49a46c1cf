#!/usr/bin/env bash
# Stop stale jobs on every worker and free the TPU: a crashed or half-killed run keeps the
# chips (processes holding /dev/accel* or /dev/vfio/*) or leaves /tmp/libtpu_lockfile behind,
# and the next job then fails with "TPU in use" or hangs.
#
# Usage: tpu/cleanup.sh --name NAME --zone ZONE --project PROJECT [options]
#   --log-dir DIR    where launch.sh keeps pid files (default $HOME/selfrag-jax-logs)
#   --dry-run        print the gcloud command instead of running it
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

while (($#)); do
  case $1 in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac
  case $1 in
    --log-dir) need_value "$@"; LOG_DIR=$2; shift 2 ;;
    *) common_option "$@"; shift "$SHIFT_BY" ;;
  esac
done
require_location
check_remote_path --log-dir "$LOG_DIR"

# Runs on each worker: the quoted heredoc is the worker's shell code, not this script's.
script=$(remote_script "log_dir=$LOG_DIR" <<'EOF'
# Jobs that launch.sh started: each is its own process group (setsid), stopped as a whole.
for f in "$log_dir"/*.pid; do [ -f "$f" ] || continue; pg=$(cat "$f"); if kill -TERM -- "-$pg" 2>/dev/null; then sleep 5; kill -KILL -- "-$pg" 2>/dev/null; fi; rm -f "$f"; done
# Anything else still holding a TPU device (lsof where installed, else fuser).
pids=$({ sudo lsof -t /dev/accel* /dev/vfio/[0-9]* 2>/dev/null || sudo fuser /dev/accel* /dev/vfio/[0-9]* 2>/dev/null; } | tr -s ' ' '\n' | grep -E '^[0-9]+$' | sort -u | tr '\n' ' ')
if [ -n "$pids" ]; then echo "$(hostname): killing $pids"; sudo kill -9 $pids; sleep 2; fi
# libtpu refuses to start while this lock exists, even when its owner is long dead.
sudo rm -f /tmp/libtpu_lockfile
echo "$(hostname): clean"
EOF
)
ssh_all "$script"
