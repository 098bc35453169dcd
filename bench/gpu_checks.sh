#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go, each bounded, each step's output in RESULTS/:
# the GPU tests (tests/test_gpu.py and the GPU cases of the rollback and op-clock tests),
# live recovery on the GPU against the CPU (bench/live_gpu.py), the rollback copy's cost
# (bench/rollback_cost.py), the CUDA-event timing overhead (bench/cuda_event_overhead.py) and
# what NCCL does when a peer dies (bench/nccl_abort.py).
#
#   bash bench/gpu_checks.sh [RESULTS]        # default RESULTS: gpu-results
#
# Expects schedc installed (pip install -e .) with a CUDA build of torch. A step that fails
# does not stop the others; the exit status is that of the first step that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:-gpu-results}
mkdir -p "$results"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
first_failure=0

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$results/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$results/$name.log"
    echo "== $name: rc $rc in $((SECONDS - t0)) s"
    if [ "$rc" -ne 0 ] && [ "$first_failure" -eq 0 ]; then first_failure=$rc; fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$results/gpu.txt"
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda",
torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "gpus", torch.cuda.device_count())' \
    | tee -a "$results/gpu.txt"

step gpu-tests "${GPU_TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -rs \
    tests/test_gpu.py tests/test_live_rollback.py tests/test_opclock.py
step live-gpu "${LIVE_GPU_S:-200}" python3 bench/live_gpu.py --json "$results/live_gpu.json"
step rollback-cost "${ROLLBACK_S:-75}" python3 bench/rollback_cost.py --device cuda --quick \
    --json "$results/rollback_cost.json"
step event-overhead "${EVENTS_S:-45}" python3 bench/cuda_event_overhead.py --device cuda \
    --json "$results/cuda_event_overhead.json"
step nccl-abort "${NCCL_S:-170}" python3 bench/nccl_abort.py --json "$results/nccl_abort.json"
exit "$first_failure"
