#!/usr/bin/env bash
# Check that every worker runs the same jax, jaxlib, libtpu and selfrag-jax and sees the same
# devices. Version skew between hosts makes a pod job hang or fail in confusing ways.
#
# Usage: tpu/versions.sh --name NAME --zone ZONE --project PROJECT [options]
#   --venv DIR             the workers' virtualenv (default $HOME/selfrag-jax-venv)
#   --expect-workers N     how many workers must answer (default: the VM's worker count)
#   --fake-output FILE     with --dry-run: pretend FILE is what the workers printed
#   --dry-run              print the gcloud commands instead of running them
# Exits 1, naming each worker's versions on one line, when the workers disagree.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

EXPECT=""
FAKE_OUTPUT=""
while (($#)); do
  case $1 in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac
  case $1 in
    --venv) need_value "$@"; VENV=$2; shift 2 ;;
    --expect-workers) need_value "$@"; EXPECT=$2; shift 2 ;;
    --fake-output) need_value "$@"; FAKE_OUTPUT=$2; shift 2 ;;
    *) common_option "$@"; shift "$SHIFT_BY" ;;
  esac
done
require_location
check_remote_path --venv "$VENV"
[[ -z $EXPECT ]] || check_count --expect-workers "$EXPECT"
if [[ -n $FAKE_OUTPUT ]]; then
  ((DRY_RUN)) || die "--fake-output only works with --dry-run"
  [[ -f $FAKE_OUTPUT ]] || die "--fake-output '$FAKE_OUTPUT' is not a file"
fi

# One tagged line per worker, so gcloud's own chatter can be told apart. jax.device_count()
# runs on all workers at once: on a pod each host needs the others to bring the TPU up.
py='import socket, importlib.metadata as md, jax, selfrag_jax; '
py+='have = {d.metadata["Name"].lower(): d.version for d in md.distributions()}; '
py+='print("SELFRAG_VERSIONS", socket.gethostname(), "jax=" + jax.__version__, '
py+='"jaxlib=" + have.get("jaxlib", "none"), "libtpu=" + have.get("libtpu", "none"), '
py+='"selfrag_jax=" + selfrag_jax.__version__, "devices=%d" % jax.device_count())'
remote="timeout 600 $VENV/bin/python -c $(quote "$py")"

if ((DRY_RUN)); then
  ssh_all "$remote"
  [[ -n $FAKE_OUTPUT ]] || { note "dry run: no worker output to compare"; exit 0; }
  output=$(<"$FAKE_OUTPUT")
else
  if [[ -z $EXPECT ]]; then
    endpoints=$("$GCLOUD" compute tpus tpu-vm describe "$NAME" "${LOC[@]}" \
      --format='value(networkEndpoints[].ipAddress)') || fail "cannot describe TPU VM $NAME"
    EXPECT=$(tr ';' '\n' <<<"$endpoints" | grep -c .) || true
  fi
  output=$(ssh_all "$remote" 2>&1) || fail "version check failed: $(tail -n 1 <<<"$output")"
fi

# "host jax=... jaxlib=... ..." per worker; everything after the host must match.
reports=$(sed -n 's/.*SELFRAG_VERSIONS //p' <<<"$output")
answered=$(grep -c . <<<"$reports") || true
((answered > 0)) || fail "no worker reported its versions"
if [[ -n $EXPECT ]] && ((answered != EXPECT)); then
  fail "$answered of $EXPECT workers reported their versions"
fi
distinct=$(cut -d ' ' -f 2- <<<"$reports" | sort -u)
if (($(grep -c . <<<"$distinct") > 1)); then
  fail "workers disagree: $(sort <<<"$reports" | paste -sd '|' | sed 's/|/ | /g')"
fi
note "all $answered workers agree: $distinct"
