#!/usr/bin/env bash
# One GPU with FP8 tensor cores (an H100), FP8 next to bf16: `hlat preflight` at the shapes of the 1B setting of
# benchmarks/gpu_step.py (dim 2048, 16 layers, 16 heads, ffn 5632, vocab 32000, seq 4096, micro-batch 4,
# bf16_mixed, no recomputation) and of llama2-7b (seq 4096, micro-batches 1 and 2, bf16_sr, full recomputation):
# bf16 matmuls, and a torchao Float8Linear's forward + backward (tensorwise and rowwise) at each block linear's
# shape. Writes benchmarks/results/preflight_gpu_fp8_{1b,7b}.{json,toml} and prints the matmul tables merged into
# hardware/p5.48xlarge.toml's own (benchmarks/measured_rows.py), the lines its [measured] section takes.
#
# torchao is not in the GPU machine's image: its wheel travels in .whl/ (docs/devices.md, "FP8").
#
#     bash benchmarks/gpu_preflight_fp8.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_setup.sh
mkdir -p benchmarks/results
out=benchmarks/results/preflight_gpu_fp8
python3 -m hlat preflight --hardware p5.48xlarge --model.dim 2048 --model.n_layers 16 --model.n_heads 16 \
    --model.ffn_dim 5632 --model.vocab_size 32000 --model.max_seq_len 4096 --train.seq_len 4096 \
    --train.micro_batch 4 --precision.mode bf16_mixed --parallel.activation_checkpoint none --dtypes bf16 \
    --fp8 tensorwise,rowwise --json --out "${out}_1b.toml" > "${out}_1b.json"
python3 -m hlat preflight --hardware p5.48xlarge --model llama2-7b --train.seq_len 4096 --micro-batches 1,2 \
    --precision.mode bf16_sr --parallel.activation_checkpoint full --dtypes bf16 --fp8 tensorwise,rowwise --json \
    --out "${out}_7b.toml" > "${out}_7b.json"
grep -h '"fp8"' "${out}_1b.json" "${out}_7b.json"  # "FP8 matmuls: measured (tensorwise, rowwise)"
python3 benchmarks/measured_rows.py hardware/p5.48xlarge.toml "${out}_1b.toml" "${out}_7b.toml"
