#!/usr/bin/env bash
# The GPU suite on a lent GPU machine, unattended (docs/devices.md, "The GPU suite"): installs the wheels carried
# in .whl/ (torchao, torchtitan and what they need beyond the machine's image), then runs each part asked for
# (default: speed, 7b, figure; about 5, 5 and 8 minutes; PART=SECONDS gives that part its own budget) and after each
# part packs everything it wrote into OUT/suite.tar.gz, beside the parts' tables (OUT/PART.md) and OUT/suite.log:
# a part cut short still leaves what the earlier ones measured.
#
#     bash benchmarks/gpu_suite.sh "$OUT" speed 7b figure
#     bash benchmarks/gpu_suite.sh "$OUT" figure=330 7b=220
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_suite.sh OUT [PART ...]}; shift
parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(speed 7b figure)
results=/tmp/hlat-gpu-suite/results
rm -rf "$results"; mkdir -p "$results" "$out"
{
    source benchmarks/gpu_setup.sh || exit 1
    python3 -c "import torchao; print('torchao', torchao.__version__)"
    for asked in "${parts[@]}"; do
        part=${asked%%=*}
        budget=(); [ "$part" = "$asked" ] || budget=(--budget-s "${asked#*=}")
        python3 benchmarks/gpu_suite.py "$part" --out "$results" "${budget[@]}" ${SUITE_ARGS:-}
        tar czf "$out/suite.tar.gz" -C "$results" .
        cp "$results"/*.md "$out"/ 2>/dev/null
    done
} 2>&1 | tee "$out/suite.log"
