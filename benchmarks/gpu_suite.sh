#!/usr/bin/env bash
# The GPU suite on a lent GPU machine, unattended: installs the wheels carried in .whl/ (torchao, torchtitan and
# what they need beyond the machine's image: docs/devices.md), then runs the parts asked for (default: speed) and
# writes everything into OUT (suite.log beside the parts' files).
#
#     bash benchmarks/gpu_suite.sh "$OUT" speed --budget-s 280
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_suite.sh OUT [PART] [suite options]}; shift
part=${1:-speed}; shift || true
mkdir -p "$out"
{
    source benchmarks/gpu_setup.sh || exit 1
    python3 -c "import torchao, torchtitan; print('torchao', torchao.__version__)"
    python3 benchmarks/gpu_suite.py "$part" --out "$out" "$@"
} 2>&1 | tee "$out/suite.log"
