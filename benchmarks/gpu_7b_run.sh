#!/usr/bin/env bash
# llama2-7b for 300 steps on one 80 GB GPU in pure bf16 (benchmarks/gpu_7b_bf16_sr.toml); needs the llama-style
# SentencePiece model at .gpu/tokenizer.model (copy ../shared/data/tokenizers/llama-sp-32k/tokenizer.model there).
# Results: benchmarks/results/gpu_7b_bf16_sr.md. The run directory goes to /dev/shm (the final checkpoint is 38 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_setup.sh
python3 -m hlat train --config benchmarks/gpu_7b_bf16_sr.toml --train.run_dir /dev/shm/hlat-7b "$@"
