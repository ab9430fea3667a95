#!/usr/bin/env bash
# Every GPU-only measurement of moejax, for a lent GPU machine (one call per part, each
# well inside ten minutes). Run from the repository root:
#
#     bash benchmarks/gpu_suite.sh OUT_DIR all       # the prepared 8-minute call, figures in
#                                                    # priority order (benchmarks/gpu_once.sh);
#                                                    # run this first on a newly lent GPU
#     bash benchmarks/gpu_suite.sh OUT_DIR kernels   # GPU tests, grouped GEMM (Triton, Mosaic)
#     bash benchmarks/gpu_suite.sh OUT_DIR sweep     # tile sweeps of both grouped-GEMM kernels
#     bash benchmarks/gpu_suite.sh OUT_DIR serving   # resident vs offload at 1.86 Θ (lagged, waiting)
#     bash benchmarks/gpu_suite.sh OUT_DIR metro     # METRO quality and device time
#     bash benchmarks/gpu_suite.sh OUT_DIR eldr      # ELDR decode-layer cost model (Qwen3 shape)
#     bash benchmarks/gpu_suite.sh OUT_DIR mfu       # stage time breakdown (32K tokens), the
#                                                    # 131K-token resident MFU, the 48-layer model
#     bash benchmarks/gpu_suite.sh OUT_DIR summary   # summary.json of the issue's figures
#
# Time limits per part (each under one 10-minute device call): kernels 8.2 min, sweep 7 min,
# serving 9 min, metro 2.5 min, eldr 7.5 min, mfu 9.5 min (breakdown <2, 131K resident <3.2, full model
# <4.5), summary 1 min.
# Writes OUT_DIR/suite.log (every step's output) and one JSON per benchmark; prints each
# step's exit status and the end of its output. Uses the machine's own JAX (no install).
set -u
out=${1:?usage: gpu_suite.sh OUT_DIR all|kernels|sweep|serving|metro|eldr|mfu|summary}
part=${2:?usage: gpu_suite.sh OUT_DIR all|kernels|sweep|serving|metro|eldr|mfu|summary}
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
all)
    exec bash "$(dirname "$0")/gpu_once.sh" "$out"
    ;;
kernels)
    step env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv;
        python3 -c "import jax, jaxlib, sys; print(sys.version); print(jax.__version__, jax.devices())"'
    # The kernels compiled for real (Triton and Mosaic GPU), METRO's kernels, the MoE layer,
    # and the streamed backends' layer pipeline on a GPU's own copy engine.
    step gpu_tests 180 python3 -m pytest -q -p no:cacheprovider -o addopts= \
        tests/test_gmm_kernel.py tests/test_gmm_mosaic.py tests/test_metro.py \
        tests/test_metro_rounds.py tests/test_moe.py tests/test_overlap.py \
        tests/test_streamed_pipeline.py
    step gmm 280 python3 -m benchmarks.gmm --json "$out/gmm.json" --repeats 5
    ;;
sweep)
    # Tile sweeps of the Triton and Mosaic GPU kernels at 16K tokens (fills GMM_TILES,
    # SWIGLU_TILES and gmm_select.MOSAIC_TILES; mosaic_over_triton feeds the backend rule).
    step gmm_tiles 420 python3 -m benchmarks.gmm --models qwen3,mixtral --tokens 16384 \
        --sweep-tiles --skip jax_tiles,dense_onehot --repeats 5 --json "$out/gmm_tiles.json"
    ;;
serving)
    # Resident against offload at 131K tokens (~1.86 Θ on an H100), offload with the lagged
    # layer loop (default) and with a wait after every layer (offload_waiting), side by side:
    # offload_over_resident, offload_exposed_transfer_fraction and where the exposed copy
    # falls (step start / between layers), offload_lagged_over_waiting.
    step backends 540 python3 -m benchmarks.backends --backends resident,offload,offload_waiting \
        --batch-tokens 131072 --block 1024 --json "$out/backends.json"
    ;;
metro)
    # Quality of the greedy and the vectorized rounds, and each one's device time from a
    # profiler trace apart from host wall (metro_kernel_device_us).
    step metro 150 python3 -m benchmarks.metro_quality --timing --json "$out/metro.json"
    ;;
eldr)
    # MoE decode-layer time against active experts (benchmarks/eldr_cost.py), Qwen3-30B-A3B
    # shape: the Pallas path (auto) and the pure-JAX tiled loop, each with stacked weights
    # (as the decode programs index them) and per-layer arrays. ELDR_DATE and ELDR_MACHINE
    # go into the cost model (eldr_cost.json: auto + stacked first, every fit under "fits").
    step env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv;
        python3 -c "import jax, jaxlib, sys; print(sys.version); print(jax.__version__, jax.devices())"'
    step eldr 420 python3 -m benchmarks.eldr_cost --shape qwen3-30b-a3b \
        --expert-impl auto,fused_tiles --source stacked,given --json "$out/eldr.json" \
        --cost-out "$out/eldr_cost.json" ${ELDR_DATE:+--date "$ELDR_DATE"} \
        ${ELDR_MACHINE:+--machine "$ELDR_MACHINE"}
    ;;
mfu)
    # Where a resident prefill batch's device time goes (Qwen3 shape, 8 layers, 32K tokens;
    # rerun after a kernel change to compare), the resident MFU at a 131K-token batch, and
    # the whole 48-layer model (resident when it fits, by the printed arithmetic).
    step breakdown 110 python3 -m benchmarks.time_breakdown --tokens 32768 \
        --json "$out/breakdown.json"
    step backends_131k 190 python3 -m benchmarks.backends --backends resident \
        --batch-tokens 131072 --steps 1 --json "$out/backends_131k.json"
    step full_model 270 python3 -m benchmarks.full_model --tokens 65536,32768 --json "$out/full_model.json"
    ;;
summary)
    step summary 60 python3 -m benchmarks.gpu_summary "$out"
    ;;
*)
    echo "unknown part $part (all, kernels, sweep, serving, metro, eldr, mfu or summary)" >&2
    exit 2
    ;;
esac
