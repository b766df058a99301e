#!/usr/bin/env bash
# What one lent GPU checks and measures, in one call of the device tool (10 minutes at most):
#
#     bash benchmarks/gpu_session.sh [MODEL [PRECISION]]      # defaults: 124m bf16
#
# 1. the world-1 CUDA tests (tests/test_cuda.py) and the 2-GPU NCCL test (skips on one GPU);
# 2. benchmarks/gpu.py: zerocc-0 and zerocc-3 against eager, torch.compile and FSDP2 (step time, MFU,
#    reserved memory, build + first step).
# Everything is written under $OUT (the device tool's folder that comes back), else benchmarks/results/.
# The GPU image brings its own torch (2.11 with CUDA 13 when last seen); zerocc is developed on 2.13 (CPU):
# the log's first line says which ran.
set -uo pipefail
model=${1:-124m}
precision=${2:-bf16}
out=${OUT:-benchmarks/results}
log=$out/gpu_session.log
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$log"
timeout 240 python3 -m pytest -q tests/test_cuda.py tests/test_schedule.py::test_stage_3_with_prefetch_on_two_gpus_matches_ddp 2>&1 | tail -40 | tee -a "$log"
timeout 330 python3 benchmarks/gpu.py --model "$model" --precision "$precision" --out "$out/gpu_${model}_${precision}.md" 2>&1 | tail -40 | tee -a "$log"
