#!/usr/bin/env bash
# Create a TPU VM: one host or a pod slice; on-demand, spot, or through a queued resource.
#
# Usage: tpu/create.sh --name NAME --zone ZONE --project PROJECT --type TYPE [options]
#   --type TYPE          accelerator type: v5p-32, v5e-16 (sent as v5litepod-16), v6e-8, v4-32, ...
#   --runtime VERSION    TPU software version (default by generation: v5p v2-alpha-tpuv5,
#                        v5e v2-alpha-tpuv5-lite, v6e v2-alpha-tpuv6e, v4 tpu-ubuntu2204-base)
#   --spot               spot capacity: cheaper, can be preempted at any time
#   --queued             request through a queued resource (waits in line for capacity)
#   --qr ID              queued resource id (default NAME-qr); implies --queued
#   --best-effort        queued best-effort tier (gcloud alpha); implies --queued
#   --valid-until DUR    give up queueing after DUR (e.g. 6h, 2d); implies --queued
#   --wait               with --queued: poll until the queued resource is ACTIVE
#   --poll SECONDS       seconds between polls with --wait (default 30)
#   --fake-states FILE   with --dry-run: queued-resource states to pretend, one per line
#   --dry-run            print the gcloud commands instead of running them
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

TYPE=""
RUNTIME=""
SPOT=0
QUEUED=0
QR=""
BEST_EFFORT=0
VALID_UNTIL=""
WAIT=0
POLL=30
FAKE_FILE=""
while (($#)); do
  case $1 in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac
  case $1 in
    --type) need_value "$@"; TYPE=$2; shift 2 ;;
    --runtime) need_value "$@"; RUNTIME=$2; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --queued) QUEUED=1; shift ;;
    --qr) need_value "$@"; QR=$2; QUEUED=1; shift 2 ;;
    --best-effort) BEST_EFFORT=1; QUEUED=1; shift ;;
    --valid-until) need_value "$@"; VALID_UNTIL=$2; QUEUED=1; shift 2 ;;
    --wait) WAIT=1; shift ;;
    --poll) need_value "$@"; POLL=$2; shift 2 ;;
    --fake-states) need_value "$@"; FAKE_FILE=$2; shift 2 ;;
    *) common_option "$@"; shift "$SHIFT_BY" ;;
  esac
done

require_location
[[ -n $TYPE ]] || die "--type is required (e.g. v5p-32, v5e-16)"
[[ $TYPE =~ ^v[0-9]+[a-z]*-[0-9]+$ ]] || die "--type '$TYPE' is not an accelerator type such as v5p-32"
# gcloud calls v5e slices "v5litepod-N"; people (and the README) say v5e-N.
[[ $TYPE == v5e-* ]] && TYPE="v5litepod-${TYPE#v5e-}"
if [[ -z $RUNTIME ]]; then
  case $TYPE in
    v5p-*) RUNTIME=v2-alpha-tpuv5 ;;
    v5litepod-*) RUNTIME=v2-alpha-tpuv5-lite ;;
    v6e-*) RUNTIME=v2-alpha-tpuv6e ;;
    v4-* | v3-* | v2-*) RUNTIME=tpu-ubuntu2204-base ;;
    *) die "no default runtime for --type '$TYPE': pass --runtime" ;;
  esac
fi
((SPOT && BEST_EFFORT)) && die "--spot and --best-effort are different tiers: pick one"
((WAIT && !QUEUED)) && die "--wait only applies to --queued (a plain create already waits)"
[[ -z $VALID_UNTIL || $VALID_UNTIL =~ ^([0-9]+[dhms])+$ ]] ||
  die "--valid-until '$VALID_UNTIL' is not a duration such as 6h or 2d"
check_count --poll "$POLL"
QR=${QR:-$NAME-qr}
[[ $QR =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] || die "--qr '$QR': lower-case letters, digits and '-'"
if [[ -n $FAKE_FILE ]]; then
  ((DRY_RUN)) || die "--fake-states only works with --dry-run"
  load_fake_states "$FAKE_FILE"
elif ((DRY_RUN)); then
  FAKE_STATES=(ACTIVE)
fi
args_checked

if ((!QUEUED)); then
  # On-demand or spot VM: gcloud returns once the VM is READY (or has failed).
  tier=()
  ((SPOT)) && tier=(--spot)
  run "$GCLOUD" compute tpus tpu-vm create "$NAME" "${LOC[@]}" \
    --accelerator-type="$TYPE" --version="$RUNTIME" "${tier[@]}"
  exit 0
fi

# Queued resource: the request waits in line; the node NAME appears once it is ACTIVE.
# The best-effort tier exists only in the alpha command group.
create=("$GCLOUD" compute tpus queued-resources create "$QR")
((BEST_EFFORT)) && create=("$GCLOUD" alpha compute tpus queued-resources create "$QR")
create+=(--node-id="$NAME" "${LOC[@]}" --accelerator-type="$TYPE" --runtime-version="$RUNTIME")
((SPOT)) && create+=(--spot)
((BEST_EFFORT)) && create+=(--best-effort)
[[ -n $VALID_UNTIL ]] && create+=(--valid-until-duration="$VALID_UNTIL")
run "${create[@]}"

((WAIT)) || exit 0
while true; do
  poll_qr "$QR"
  case $STATE in
    ACTIVE) exit 0 ;;
    FAILED | SUSPENDED | SUSPENDING | PREEMPTED | NOT_FOUND)
      fail "queued resource $QR is $STATE: see 'gcloud compute tpus queued-resources describe $QR'" ;;
    *) pause "$POLL" ;;
  esac
done
