#!/usr/bin/env bash
# What one lent GPU checks and measures, in one call of the device tool (10 minutes at most):
#
#     bash benchmarks/gpu_session.sh [SECONDS]      # default 450: everything ends inside it
#
# 1. the machine and its torch (the GPU image brings its own: 2.11 with CUDA 13 when last seen; zerocc is
#    developed on 2.13, CPU);
# 2. the world-1 CUDA tests (tests/test_cuda.py: stages 0-3 bit for bit as eager, bf16 as the reference, the plan
#    against the allocator, the free-memory budget) and the 2-GPU NCCL test (skips on one GPU);
# 3. benchmarks/gpu.py: zerocc-0 and zerocc-3 against eager, torch.compile and FSDP2 (step time, MFU, reserved
#    memory, build + first step, one profiled step each: kernels, aten calls, device busy time) on the 124M GPT
#    in bf16, then the 705M GPT with the time left.
# Every part has its share of the seconds, so a failure or a hang in one still leaves the others' results.
# Everything is written under $OUT (the device tool's folder that comes back), else benchmarks/results/.
set -uo pipefail
budget=${1:-450}
out=${OUT:-benchmarks/results}
log=$out/gpu_session.log
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
deadline=$((SECONDS + budget))
left() { local s=$((deadline - SECONDS)); (( s > $1 )) && s=$1; echo $(( s > 0 ? s : 1 )); }
{
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name())"
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
} 2>&1 | tee "$log"
timeout "$(left 150)" python3 -m pytest -q -rfE --tb=short tests/test_cuda.py \
    tests/test_schedule.py::test_stage_3_with_prefetch_on_two_gpus_matches_ddp 2>&1 | tee "$out/gpu_tests.log" \
    | tail -40 | tee -a "$log"
timeout "$(left 200)" python3 benchmarks/gpu.py --model 124m --precision bf16 --profile 12 --out "$out/gpu_124m_bf16.md" 2>&1 \
    | tail -30 | tee -a "$log"
(( deadline - SECONDS > 90 )) && timeout "$(left 400)" python3 benchmarks/gpu.py --model 705m --precision bf16 \
    --systems eager,FSDP2,zerocc-0,zerocc-3 --out "$out/gpu_705m_bf16.md" 2>&1 | tail -30 | tee -a "$log"
echo "done in $SECONDS s" | tee -a "$log"
