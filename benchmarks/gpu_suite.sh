#!/usr/bin/env bash
# Every GPU-only measurement of moejax, for a lent GPU machine (one call per part, each
# well inside ten minutes). Run from the repository root:
#
#     bash benchmarks/gpu_suite.sh OUT_DIR kernels   # GPU tests, grouped GEMM, tile sweep
#     bash benchmarks/gpu_suite.sh OUT_DIR serving   # METRO kernel, resident vs offload
#     bash benchmarks/gpu_suite.sh OUT_DIR eldr      # ELDR decode-layer cost model (Qwen3 shape)
#
# Writes OUT_DIR/suite.log (every step's output) and one JSON per benchmark; prints each
# step's exit status and the end of its output. Uses the machine's own JAX (no install).
set -u
out=${1:?usage: gpu_suite.sh OUT_DIR kernels|serving|eldr}
part=${2:?usage: gpu_suite.sh OUT_DIR kernels|serving|eldr}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
log=$out/suite.log

step() {   # step NAME SECONDS COMMAND...: run with a time limit, keep the output
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== $name: $*" >>"$log"
    timeout "$limit" "$@" >>"$log.part" 2>&1
    rc=$?
    cat "$log.part" >>"$log"
    echo "=== $name: rc=$rc, $(( $(date +%s) - start )) s" | tee -a "$log"
    tail -n "${TAIL:-25}" "$log.part"
    rm -f "$log.part"
}

case $part in
kernels)
    step env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv;
        python3 -c "import jax, jaxlib, sys; print(sys.version); print(jax.__version__, jax.devices())"'
    step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -o addopts= \
        tests/test_gmm_kernel.py tests/test_metro.py tests/test_moe.py tests/test_overlap.py
    step gmm 280 python3 benchmarks/gmm.py --json "$out/gmm.json" --repeats 5
    step gmm_tiles 170 python3 benchmarks/gmm.py --models qwen3,mixtral --tokens 16384 \
        --sweep-tiles --skip jax_tiles,dense_onehot --repeats 5 --json "$out/gmm_tiles.json"
    ;;
serving)
    step backends 300 python3 benchmarks/backends.py --backends resident,offload \
        --json "$out/backends.json"
    step gmm_tiles 200 python3 benchmarks/gmm.py --models qwen3,mixtral --tokens 16384 \
        --sweep-tiles --skip jax_tiles,dense_onehot --repeats 5 --json "$out/gmm_tiles.json"
    step metro 90 python3 benchmarks/metro_quality.py --json "$out/metro.json"
    ;;
eldr)
    # MoE decode-layer time against active experts (benchmarks/eldr_cost.py), Qwen3-30B-A3B
    # shape: the Pallas path (auto) and the pure-JAX tiled loop, each with stacked weights
    # (as the decode programs index them) and per-layer arrays. ELDR_DATE and ELDR_MACHINE
    # go into the cost model (eldr_cost.json: auto + stacked first, every fit under "fits").
    step env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv;
        python3 -c "import jax, jaxlib, sys; print(sys.version); print(jax.__version__, jax.devices())"'
    step eldr 420 python3 benchmarks/eldr_cost.py --shape qwen3-30b-a3b \
        --expert-impl auto,fused_tiles --source stacked,given --json "$out/eldr.json" \
        --cost-out "$out/eldr_cost.json" ${ELDR_DATE:+--date "$ELDR_DATE"} \
        ${ELDR_MACHINE:+--machine "$ELDR_MACHINE"}
    ;;
*)
    echo "unknown part $part (kernels, serving or eldr)" >&2
    exit 2
    ;;
esac
