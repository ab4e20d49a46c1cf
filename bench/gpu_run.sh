#!/usr/bin/env bash
# The accelerator figures of the benchmarks, in one short run on a GPU machine:
#   bench/gpu_run.sh OUT_DIR
# writes OUT_DIR/{train_gpu,decode_gpu,decode_gpu_7b,gpu_check}.json and a log of each. Uses the machine's
# own python3 and packages (jax, flax, optax, torch, transformers); each part has its own
# time limit so that one slow part does not cost the others.
set -u
out=${1:?usage: bench/gpu_run.sh OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit
cd "$(dirname "$0")/.." || exit
export PYTHONUNBUFFERED=1 SELFRAG_NO_PROGRESS=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python=${PYTHON:-python3}
nvidia-smi -L
$python -c 'import jax, flax, optax, torch, transformers; print("jax", jax.__version__, jax.devices(), "flax", flax.__version__, "optax", optax.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
part() {  # part NAME SECONDS ARGS...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout "$limit" "$python" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - start)) s"
  tail -n 4 "$out/$name.log"
}
part train_gpu "${TRAIN_LIMIT:-120}" -m bench.bench_train --accelerator --steps 10 --out "$out/train_gpu.json"
part decode_gpu "${DECODE_LIMIT:-240}" -m bench.bench_decode --accelerator --out "$out/decode_gpu.json"
part gpu_check "${CHECK_LIMIT:-150}" bench/gpu_check.py --out "$out/gpu_check.json"
# The released size (7B, random weights, bfloat16) against transformers running the released
# algorithm on the same GPU; last, as its export to transformers takes the longest.
part decode_gpu_7b "${DECODE_7B_LIMIT:-420}" -m bench.bench_decode --accelerator --preset selfrag-7b \
  --out "$out/decode_gpu_7b.json"
