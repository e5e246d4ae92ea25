#!/usr/bin/env bash
# The GPU checks in one go, on a host with a CUDA GPU and the project's dependencies importable
# by $PYTHON (default python3), from the repository root:
#   scripts/gpu_check.sh [OUT]    (OUT: where logs and results go; default runs/gpu-check)
# GPU_CHECK_STEPS names the steps to run (default: all four, in this order); GPU_INPUT_ARGS
# adds options to step 2 (for example "--before PATH").
# 1. python -m benchmarks trainer_gpu: ViT-B/16 bf16, compile off/on, batch 256 and the largest
#    that fits, against a bare timm + torch loop; writes benchmarks/results/trainer_gpu.json and
#    the GPU's entry in benchmarks/results/throughput.json (what hetero plan reads);
# 2. python -m benchmarks gpu_input: the trainer fed by data servers on loopback;
# 3. the CUDA-only tests (tests/trainer/test_cuda.py, the NVML metric test);
# 4. the real-image learning test on the GPU: the job's top-1 equals the export's scored by
#    plain timm.
# Each step has its own time limit and the next runs whatever the last did; the exit code is
# the number of steps that failed.
set -uo pipefail
out=${1:-runs/gpu-check}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
failed=0

steps=" ${GPU_CHECK_STEPS:-trainer_gpu gpu_input tests learns} "

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    [[ $steps == *" $name "* ]] || return 0
    echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    local started=$SECONDS
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    local code=$?
    tail -n 25 "$out/$name.log"
    echo "=== $name: exit $code in $((SECONDS - started)) s"
    [ "$code" -eq 0 ] || failed=$((failed + 1))
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit \
    --format=csv >"$out/nvidia-smi.csv" 2>&1 || true
cat "$out/nvidia-smi.csv"
$py -c 'import torch, timm, grpc; print("torch", torch.__version__, "cuda", torch.version.cuda,
"timm", timm.__version__, "grpc", grpc.__version__, torch.cuda.get_device_name(0))'

step trainer_gpu 270 $py -m benchmarks trainer_gpu
# shellcheck disable=SC2086 # GPU_INPUT_ARGS: words on purpose
step gpu_input 330 $py -m benchmarks gpu_input ${GPU_INPUT_ARGS:-}
step tests 80 $py -m pytest -q -p no:cacheprovider -rs tests/trainer/test_cuda.py \
    "tests/trainer/test_emf.py::test_gpu_utilisation_comes_from_nvml_on_a_gpu"
step learns 90 $py -m pytest -q -p no:cacheprovider -rs --basetemp="$out/learns-tmp" \
    tests/trainer/test_learns_real_images.py
cp benchmarks/results/trainer_gpu.json benchmarks/results/gpu_input.json \
    benchmarks/results/throughput.json "$out"/ 2>/dev/null
echo "=== $failed step(s) failed"
exit "$failed"
