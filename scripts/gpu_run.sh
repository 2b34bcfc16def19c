#!/usr/bin/env bash
# Run the GPU tests and the benchmarks on a machine with a CUDA GPU; logs and results go to one
# folder. From the repository root, with the torch and triton already installed there:
#
#   scripts/gpu_run.sh [OUT_DIR]        OUT_DIR: default $OUT, else ./gpu_results
#
# Stages, in this order by default (STAGES="smoke bench" runs two of them):
#   smoke        the launch paths first: direct launches against Triton's, the lanes kernel, the
#                complex kernels (smoke.log)
#   tests        the GPU suites (tests/test_gpu.py, test_gpu_models.py) and the suites that also
#                run their Triton cases on CUDA tensors (tests.log)
#   conformance  the conformance grid, tests/test_gpu_conformance.py (conformance.log, .json)
#   bench        bench/gpu_bench.py: S1-S8 against the anchor (h200.json, bench.log)
#   host         bench/host_profile.py --profile train: S6's host time split (host_profile.json,
#                host.log, host_trace.json.gz: a Chrome trace of five steps)
#   train        bench/train_bench.py: layer and model training steps (train.json, train.log)
#   decode, varlen    bench/decode_bench.py, bench/varlen_bench.py (decode.json, varlen.json)
#   ncu          not by default: bench/ncu_profile.py, Nsight Compute's counters of every kernel
#                of a training step (ncu.json, ncu.log; NCU_ARGS="--anchor S1 --source S1")
# OUT_DIR also gets environment.txt (GPU, driver, torch, triton, Python, git commit). With the
# bench stage and mamba's sources in bench/anchor_src (bench/anchor.py), the anchor builds in the
# background from the start (anchor_build.log); the bench stage waits for it.
#
# Environment: STAGES, TESTS (pytest targets of the tests stage), PYTEST_ARGS, BENCH_ARGS,
# HOST_ARGS, TRAIN_ARGS, DECODE_ARGS, VARLEN_ARGS, NCU_ARGS (extra arguments),
# CONFORMANCE_WORKERS (8). The *_ARGS are split at spaces, not parsed as shell words: quotes stay
# in the arguments, so an empty value is written --extras= rather than --extras ''. Exits non-zero
# if a stage failed.
set -uo pipefail
OUT_DIR="${1:-${OUT:-gpu_results}}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CONFORMANCE_OUT="$OUT_DIR/conformance.json"

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import platform, torch, triton; print('torch', torch.__version__, 'triton', \
triton.__version__, 'python', platform.python_version())"
    # GIT_COMMIT: the commit the tree was copied from, where the copy's own .git is not it.
    echo "commit ${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
} > "$OUT_DIR/environment.txt" 2>&1
cat "$OUT_DIR/environment.txt"

TESTS="${TESTS:-tests/test_gpu.py tests/test_gpu_models.py \
tests/test_state_update.py tests/test_triton_interpreter.py tests/test_scan.py \
tests/test_state_varlen.py tests/test_ops.py tests/test_compile.py tests/test_complex.py}"
WORKERS=()
if python3 -c "import xdist" 2>/dev/null; then WORKERS=(-n "${TEST_WORKERS:-8}"); fi

STAGES="${STAGES:-smoke tests conformance bench host train decode varlen}"
ANCHOR_BUILD=
if [[ " $STAGES " == *" bench "* ]]; then
    if [ -d bench/anchor_src/csrc/selective_scan ]; then
        (cd bench && python3 -c "import anchor; anchor.build()") > "$OUT_DIR/anchor_build.log" 2>&1 &
        ANCHOR_BUILD=$!
    else  # git-ignored: a copied tree may lack it
        echo "WARNING: no bench/anchor_src/csrc/selective_scan: the bench stage compares with the" \
            "recorded anchor figures, not an anchor built here" | tee "$OUT_DIR/anchor_build.log"
    fi
fi

failed=0
run() {  # run NAME LOG COMMAND...: append the command's output to LOG; count a failure
    local name=$1 log=$2 start=$SECONDS
    shift 2
    echo "== $name: $*" | tee -a "$log"
    "$@" 2>&1 | tee -a "$log" | tail -n 30
    local status=${PIPESTATUS[0]}
    echo "== $name: exit $status after $((SECONDS - start)) s" | tee -a "$log"
    [ "$status" = 0 ] || failed=$((failed + 1))
}

for stage in $STAGES; do
    case "$stage" in
        # TESTS and the *_ARGS variables are word lists: unquoted on purpose.
        smoke) run smoke "$OUT_DIR/smoke.log" python3 -m pytest -p no:cacheprovider -rf \
            --tb=short "${WORKERS[@]}" tests/test_gpu.py -k "direct or dependent or options_real" \
            tests/test_complex.py ${PYTEST_ARGS:-} ;;
        tests) run tests "$OUT_DIR/tests.log" python3 -m pytest -p no:cacheprovider -rf \
            --tb=short "${WORKERS[@]}" $TESTS ${PYTEST_ARGS:-} ;;
        # The grid compiles about 900 kernel specializations: a stage of its own. 15 and 10
        # workers, each holding two calls' outputs and gradients, ran an 80 GB H100 out of memory.
        conformance) run conformance "$OUT_DIR/conformance.log" python3 -m pytest \
            -p no:cacheprovider -rf --tb=short -n "${CONFORMANCE_WORKERS:-8}" \
            tests/test_gpu_conformance.py ;;
        bench)
            if [ -n "$ANCHOR_BUILD" ]; then wait "$ANCHOR_BUILD"; fi
            run bench "$OUT_DIR/bench.log" python3 bench/gpu_bench.py --out "$OUT_DIR" \
                ${BENCH_ARGS:-} ;;
        host) run host "$OUT_DIR/host.log" python3 bench/host_profile.py --profile train \
            --out "$OUT_DIR/host_profile.json" --trace "$OUT_DIR/host_trace.json.gz" \
            ${HOST_ARGS:-} ;;
        train) run train "$OUT_DIR/train.log" python3 bench/train_bench.py --out "$OUT_DIR" \
            ${TRAIN_ARGS:-} ;;
        decode) run decode "$OUT_DIR/bench.log" python3 bench/decode_bench.py --out "$OUT_DIR" \
            ${DECODE_ARGS:-} ;;
        varlen) run varlen "$OUT_DIR/bench.log" python3 bench/varlen_bench.py --out "$OUT_DIR" \
            ${VARLEN_ARGS:-} ;;
        ncu) run ncu "$OUT_DIR/ncu.log" python3 bench/ncu_profile.py --out "$OUT_DIR/ncu.json" \
            ${NCU_ARGS:-} ;;
        *) echo "unknown stage $stage"; failed=$((failed + 1)) ;;
    esac
done
ls "$OUT_DIR"
exit "$failed"
