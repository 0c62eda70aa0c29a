#!/usr/bin/env bash
# One GPU, in one go: `hlat preflight` on the `small` model (the measured profile is committed as
# benchmarks/results/preflight_gpu.toml), then benchmarks/planner_measured.py --gpu: four single-GPU hlat runs
# (micro-batch, precision, recomputation), each between preflights in its own precision and recomputation, and
# the planner's predicted against measured step time (benchmarks/results/planner_measured_gpu.{md,json}).
#
#     PYTHON=.venv/bin/python bash benchmarks/gpu_preflight.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p benchmarks/results
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
"$PYTHON" -m hlat preflight --model small --model.tie_embeddings false --train.seq_len 1024 --micro-batches 1,4 \
    --dtypes fp32,bf16 --json --out benchmarks/results/preflight_gpu.toml > benchmarks/results/preflight_gpu.json
"$PYTHON" benchmarks/planner_measured.py --gpu
cat benchmarks/results/planner_measured_gpu.md
