#!/usr/bin/env bash
# Every GPU figure in one prepared device call (at most 8 minutes; see benchmarks/gpu_once.py).
# Run from the repository root on the device machine, in one call of about 9 minutes:
#
#     bash benchmarks/gpu_once.sh [OUT_DIR] [--budget-s S] [--only STEPS]   # OUT_DIR: $OUT
#     bash benchmarks/gpu_once.sh OUT_DIR --dry-run                          # CPU rehearsal
#
# Each step's JSON lands in OUT_DIR as soon as it exists, with gpu_once.json (the record)
# and summary.json (the headline figures so far) rewritten after every step, so a timeout
# keeps what was done. Uses the machine's own JAX (no install).
set -u
out=${1:-${OUT:-}}
if [ -z "$out" ] || [ "${out#--}" != "$out" ]; then
    out=${OUT:?usage: gpu_once.sh OUT_DIR [--budget-s S] [--dry-run] [--only STEPS] (or set OUT)}
else
    shift
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
case " $* " in
*" --dry-run "*) ;;
*) export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} ;;
esac
exec python3 -m benchmarks.gpu_once "$out" "$@"
