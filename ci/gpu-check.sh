#!/usr/bin/env bash
# The GPU check (ci/gpu_check.py): the nccl/CUDA path on one GPU, every verdict and figure in
# OUT/summary.json and OUT/summary.md, within 8 minutes by default (--budget-s 450).
#   bash ci/gpu-check.sh OUT [--device cuda|cpu] [--steps N] [--ppo-steps N] [--budget-s S] ...
# Uses the project's venv when there is one, else the machine's python3 and its packages (a GPU
# machine's own torch and transformers: the pins are not needed to run it).
case "${1:-}" in  # -h/--help: the usage above, and nothing else
    -h | --help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 0 ;;
esac
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PARITY_PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PY" ci/gpu_check.py "$@"
