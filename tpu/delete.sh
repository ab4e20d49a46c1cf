#!/usr/bin/env bash
# Delete a TPU VM, or the queued resource that owns it (which deletes its VM too).
#
# Usage: tpu/delete.sh --name NAME --zone ZONE --project PROJECT [options]
#   --queued         the VM came from a queued resource: delete that (with --force)
#   --qr ID          queued resource id (default NAME-qr); implies --queued
#   --dry-run        print the gcloud command instead of running it
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

QUEUED=0
QR=""
while (($#)); do
  case $1 in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac
  case $1 in
    --queued) QUEUED=1; shift ;;
    --qr) need_value "$@"; QR=$2; QUEUED=1; shift 2 ;;
    *) common_option "$@"; shift "$SHIFT_BY" ;;
  esac
done
require_location
QR=${QR:-$NAME-qr}
[[ $QR =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] || die "--qr '$QR': lower-case letters, digits and '-'"

# --quiet: no "are you sure" prompt, so this also works from scripts.
if ((QUEUED)); then
  run "$GCLOUD" compute tpus queued-resources delete "$QR" "${LOC[@]}" --force --quiet
else
  run "$GCLOUD" compute tpus tpu-vm delete "$NAME" "${LOC[@]}" --quiet
fi
