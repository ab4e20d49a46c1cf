#!/usr/bin/env bash
# Run a short command on ALL workers and wait for it: stage data, inspect disks, etc.
# Long jobs belong in launch.sh (detached, logged, cleaned up).
#
# Usage: tpu/exec.sh --name NAME --zone ZONE --project PROJECT [--dry-run] -- COMMAND [ARGS...]
#   Each word is quoted for the worker's shell; for pipes or '&&' pass: -- bash -c 'a && b'
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

while (($#)); do
  case $1 in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac
  case $1 in
    --) shift; break ;;
    *) common_option "$@"; shift "$SHIFT_BY" ;;
  esac
done
require_location
(($#)) || die "no command given: add -- COMMAND [ARGS...]"
ssh_all "$(quote_all "$@")"
