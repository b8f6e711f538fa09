#!/usr/bin/env bash
# GPU tests and benchmarks in one call.
#
# Here (a machine with cargo, no GPU needed):   scripts/gpu-check.sh build
#   builds the release `tcc` with CUDA support, the GPU test binaries and the benchmark
#   artifacts into .gpu/ (git-ignored).
# On the GPU machine (no Rust there):           bash scripts/gpu-check.sh device
#   runs the GPU tests (TCC_REQUIRE_GPU=1: a missing GPU fails them), compute-sanitizer
#   memcheck on every example, tcc's benchmarks and PyTorch's (bench/torch_bench.py), and
#   prints a short table last. `device-tests` runs only the tests and memcheck,
#   `device-bench` only the benchmarks and the table (each fits one 10-minute call).
#   `device-onnx` runs the ONNX backend cases on the GPU and bench/onnx_models.py.
#   `device-dp` runs the data-parallel (NCCL) tests and benchmarks beside PyTorch DDP.
#   `device-fuzz` runs issue 32's edited-manifest campaign with CUDA steps (memcheck too).
#   `device-load` times each example's first step from a PTX-only and a SASS artifact.
#   `device-ckpt` runs `--mem-budget` at the memory of PyTorch's per-block checkpointing.
# Without an argument: `build` when cargo is present, then `device` when a GPU is.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=.gpu
mode="${1:-auto}"

# The test executables cargo builds for `cargo test --no-run ARGS` whose target name
# contains $1 (one per line).
test_executables() {
    local want="$1"
    shift
    cargo test --release --no-run --message-format=json "$@" | WANT="$want" python3 -c 'import json, os, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and os.environ["WANT"] in m["target"]["name"]:
        print(m["executable"])'
}

build() {
    set -e
    mkdir -p "$OUT"
    cargo build --release -p tcc --features cuda
    cp target/release/tcc "$OUT/tcc"
    # Test binaries: the GPU differential tests and the runtime's CUDA tests.
    test_executables gpu -p tcc-tests --features cuda --test gpu | head -1 | xargs -I{} cp {} "$OUT/gpu-tests"
    test_executables cuda -p tcc-runtime --features cuda \
        | while read -r exe; do cp "$exe" "$OUT/runtime-$(basename "$exe" | sed 's/-[0-9a-f]*$//')"; done
    # Issue 32's edited-manifest campaign with CUDA steps (`device-fuzz`).
    test_executables artifact_integrity -p tcc-tests --features cuda --test artifact_integrity \
        | head -1 | xargs -I{} cp {} "$OUT/artifact-integrity"
    # The ONNX backend cases on the GPU (`device-onnx`), with the onnx package's data (the GPU
    # machine cannot install the pinned package).
    test_executables onnx_backend -p tcc-tests --features cuda --test onnx_backend | head -1 \
        | xargs -I{} cp {} "$OUT/onnx-backend"
    local data
    data="$(python3 -c 'import onnx, os; print(os.path.dirname(onnx.__file__))')/backend/test/data"
    rm -rf "$OUT/onnx-data" && mkdir -p "$OUT/onnx-data"
    for f in pytorch-converted pytorch-operator simple; do cp -r "$data/$f" "$OUT/onnx-data/"; done
    ls -la "$OUT"
}

device() {
    # $1: all (default), tests (GPU tests and memcheck) or bench (benchmarks and summary).
    local part="${1:-all}" T="$OUT/tcc" log="$OUT/log" status=0
    mkdir -p "$log"
    # Artifacts are compiled here by the carried `tcc` (the gpt one holds 1 GiB of params
    # and optimizer state: too big to carry).
    "$T" build examples/mlp.tdsl --target cuda --emit artifact -o "$OUT/mlp.tcc" 2>>"$log/build.txt"
    "$T" build examples/cnn.tdsl --target cuda --emit artifact -o "$OUT/cnn.tcc" 2>>"$log/build.txt"
    "$T" build examples/gpt.tdsl --target cuda --emit artifact -o "$OUT/gpt.tcc" 2>>"$log/build.txt"
    # The same steps recomputing activations to fit under half of PyTorch eager's peak
    # (3.75 GiB for gpt, 878 MiB for cnn, measured by bench/torch_bench.py).
    "$T" build examples/cnn.tdsl --mem-budget 430MiB --target cuda --emit artifact -o "$OUT/cnn-remat.tcc" 2>>"$log/build.txt"
    "$T" build examples/gpt.tdsl --mem-budget 1.85GiB --target cuda --emit artifact -o "$OUT/gpt-remat.tcc" 2>>"$log/build.txt"
    grep -E "^remat:" "$log/build.txt"
    "$T" build bench/gelu.tdsl --target cuda --emit artifact -o "$OUT/gelu.tcc" 2>>"$log/build.txt"
    "$T" build bench/gemm_f32.tdsl --target cuda --emit artifact -o "$OUT/gemm_f32.tcc" 2>>"$log/build.txt"
    "$T" build bench/gemm_f32.tdsl --allow-tf32 --target cuda --emit artifact -o "$OUT/gemm_tf32.tcc" 2>>"$log/build.txt"
    "$T" build bench/gemm_bf16.tdsl --target cuda --emit artifact -o "$OUT/gemm_bf16.tcc" 2>>"$log/build.txt"
    "$T" build bench/matmul_edges.tdsl --target cuda --emit artifact -o "$OUT/matmul-edges.tcc" 2>>"$log/build.txt"
    "$T" build bench/matmul_edges.tdsl --allow-tf32 --target cuda --emit artifact -o "$OUT/matmul-edges-tf32.tcc" 2>>"$log/build.txt"
    "$T" build bench/conv_edges.tdsl --target cuda --emit artifact -o "$OUT/conv-edges.tcc" 2>>"$log/build.txt"
    "$T" build examples/tiny.tdsl --target cuda --emit artifact -o "$OUT/tiny-small.tcc" 2>>"$log/build.txt"
    "$T" build examples/mlp.tdsl --set B=8 --set D=32 --target cuda --emit artifact -o "$OUT/mlp-small.tcc" 2>>"$log/build.txt"
    "$T" build examples/cnn.tdsl --set B=4 --set C=16 --set S=16 --target cuda --emit artifact -o "$OUT/cnn-small.tcc" 2>>"$log/build.txt"
    "$T" build examples/gpt.tdsl --set L=2 --set D=64 --set H=2 --set T=64 --set B=2 --set V=128 --target cuda --emit artifact -o "$OUT/gpt-small.tcc" 2>>"$log/build.txt"
    grep -E "^compiled" "$log/build.txt"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    if [ "$part" != bench ]; then
        echo "== GPU tests"
        for t in "$OUT"/gpu-tests "$OUT"/runtime-*; do
            [ -x "$t" ] || continue
            if TCC_REQUIRE_GPU=1 TCC_REQUIRE_CUDA=1 "$t" --test-threads 1 >"$log/$(basename "$t").txt" 2>&1; then
                echo "ok   $(basename "$t"): $(grep -E '^test result' "$log/$(basename "$t").txt" | tail -1)"
            else
                echo "FAIL $(basename "$t")"; tail -30 "$log/$(basename "$t").txt"; status=1
            fi
        done
        echo "== compute-sanitizer memcheck"
        CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
        for m in tiny-small mlp-small cnn-small gpt-small matmul-edges matmul-edges-tf32 conv-edges; do
            if [ -n "$CS" ]; then
                if "$CS" --tool memcheck --error-exitcode 3 "$T" run "$OUT/$m.tcc" --steps 2 >"$log/memcheck-$m.txt" 2>&1; then
                    echo "clean $m: $(grep -E 'ERROR SUMMARY' "$log/memcheck-$m.txt" | tail -1)"
                else
                    echo "DIRTY $m"; tail -20 "$log/memcheck-$m.txt"; status=1
                fi
            else
                echo "compute-sanitizer not found"
            fi
        done
    fi
    if [ "$part" != tests ]; then
        echo "== tcc benchmarks"
        for m in mlp cnn cnn-remat gpt gpt-remat gelu gemm_f32 gemm_tf32 gemm_bf16; do
            "$T" run "$OUT/$m.tcc" --steps 20 --every 100 >"$log/tcc-$m.txt" 2>&1 || status=1
            echo "$m: $(grep -E 'step time|device memory|arena:' "$log/tcc-$m.txt" | tr '\n' ' ')"
        done
        echo "== PyTorch"
        python3 bench/torch_bench.py --json "$log/torch.json" >"$log/torch.txt" 2>&1 || status=1
        tail -25 "$log/torch.txt"
        echo "== summary"
        python3 bench/summary.py "$log" || true
    fi
    return $status
}

# Issue 32's edited-manifest campaign on the GPU: artifacts whose manifest was edited (and
# its checksums recomputed) load or fail with a typed error; every model that loads runs a
# step, CUDA ones on GPU 0 (TCC_FUZZ_CUDA=1). FUZZ_SANITIZED cases (default 300) run under
# compute-sanitizer memcheck, then FUZZ_CASES (default 3000) without it.
device_fuzz() {
    local log="$OUT/log" status=0 t="$OUT/artifact-integrity" CS
    mkdir -p "$log"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    run_fuzz() {
        local name="$1" cases="$2" start rc
        shift 2
        start=$(date +%s)
        TCC_FUZZ_CUDA=1 TCC_FUZZ_CASES="$cases" "$@" "$t" edited_manifests --test-threads 1 \
            >"$log/fuzz-$name.txt" 2>&1
        rc=$?
        echo "$name: $cases cases in $(( $(date +%s) - start )) s, exit $rc;" \
            "CUDA steps: $(grep -c '^fuzz-step Cuda: ran' "$log/fuzz-$name.txt") ran," \
            "$(grep -c '^fuzz-step Cuda: step error' "$log/fuzz-$name.txt") failed with an error," \
            "$(grep -c '^fuzz-step Cuda: session error' "$log/fuzz-$name.txt") sessions refused;" \
            "CPU steps: $(grep -c '^fuzz-step Cpu' "$log/fuzz-$name.txt")"
        grep -E "ERROR SUMMARY|^test result|panicked|past the" "$log/fuzz-$name.txt" | head -5
        # A loaded CUDA model's step has no reason to fail: count one as a failure.
        if grep -q '^fuzz-step Cuda: step error' "$log/fuzz-$name.txt"; then rc=1; fi
        return $rc
    }
    if [ -n "$CS" ]; then
        run_fuzz memcheck "${FUZZ_SANITIZED:-300}" "$CS" --tool memcheck --error-exitcode 3 || status=1
    else
        echo "compute-sanitizer not found"; status=1
    fi
    run_fuzz plain "${FUZZ_CASES:-3000}" || status=1
    return $status
}

# ONNX: the backend test cases on the GPU (tests/tests/onnx_backend.rs with
# TCC_ONNX_DEVICE=cuda), then resnet18, mobilenet_v2 and a 4-layer GPT-2 exported from PyTorch
# and run by tcc on the GPU and the CPU beside ONNX Runtime and PyTorch (bench/onnx_models.py).
device_onnx() {
    local log="$OUT/log" status=0
    mkdir -p "$log"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo "== ONNX backend cases on the GPU"
    if TCC_ONNX_DEVICE=cuda TCC_ONNX_DATA="$OUT/onnx-data" "$OUT/onnx-backend" --nocapture >"$log/onnx-backend.txt" 2>&1; then
        echo "ok"
    else
        echo "FAIL"; status=1
    fi
    grep -E "^(FAIL|onnx_backend)" "$log/onnx-backend.txt"
    echo "== real architectures"
    python3 bench/onnx_models.py --tcc "$OUT/tcc" --json "$log/onnx-models.json" 2>"$log/onnx-models.txt" || status=1
    tail -5 "$log/onnx-models.txt"
    return $status
}

# Mixed precision (`--amp bf16|f16`): memcheck of small 16-bit steps, the examples' steps
# in both dtypes, and PyTorch autocast (fused optimizers, eager, torch.compile and the cnn in
# channels_last) side by side.
device_amp() {
    local T="$OUT/tcc" log="$OUT/log" status=0
    mkdir -p "$log"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    for a in bf16 f16; do
        for m in mlp cnn gpt; do
            "$T" build examples/$m.tdsl --amp $a --target cuda --emit artifact -o "$OUT/$m-$a.tcc" 2>>"$log/build-amp.txt" || status=1
        done
        "$T" build examples/mlp.tdsl --amp $a --set B=8 --set D=32 --target cuda --emit artifact -o "$OUT/mlp-small-$a.tcc" 2>>"$log/build-amp.txt" || status=1
        "$T" build examples/cnn.tdsl --amp $a --set B=4 --set C=16 --set S=16 --target cuda --emit artifact -o "$OUT/cnn-small-$a.tcc" 2>>"$log/build-amp.txt" || status=1
        "$T" build examples/gpt.tdsl --amp $a --set L=2 --set D=64 --set H=2 --set T=64 --set B=2 --set V=128 --target cuda --emit artifact -o "$OUT/gpt-small-$a.tcc" 2>>"$log/build-amp.txt" || status=1
    done
    grep -E "^compiled|error" "$log/build-amp.txt"
    echo "== compute-sanitizer memcheck (--amp)"
    CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    for m in mlp-small-bf16 cnn-small-bf16 gpt-small-bf16 gpt-small-f16; do
        if [ -n "$CS" ] && "$CS" --tool memcheck --error-exitcode 3 "$T" run "$OUT/$m.tcc" --steps 2 >"$log/memcheck-$m.txt" 2>&1; then
            echo "clean $m: $(grep -E 'ERROR SUMMARY' "$log/memcheck-$m.txt" | tail -1)"
        else
            echo "DIRTY $m"; tail -20 "$log/memcheck-$m.txt"; status=1
        fi
    done
    echo "== tcc --amp"
    for a in bf16 f16; do
        for m in mlp cnn gpt; do
            "$T" run "$OUT/$m-$a.tcc" --steps 20 --every 10 >"$log/tcc-$m-$a.txt" 2>&1 || status=1
            echo "$m-$a: $(grep -E 'step +(1|20) |loss scale|step time|device memory of|arena:' "$log/tcc-$m-$a.txt" | tr '\n' ' ')"
        done
    done
    echo "== PyTorch autocast"
    python3 bench/torch_bench.py --amp bf16 --cases mlp,cnn,gpt --modes eager,compile,eager_cl --json "$log/torch-bf16.json" >"$log/torch-bf16.txt" 2>&1 || status=1
    sed -n '/## results/,$p' "$log/torch-bf16.txt"
    python3 bench/torch_bench.py --amp f16 --cases mlp,cnn,gpt --modes eager,compile --json "$log/torch-f16.json" >"$log/torch-f16.txt" 2>&1 || status=1
    sed -n '/## results/,$p' "$log/torch-f16.txt"
    echo "== summary (--amp)"
    python3 bench/summary.py "$log" | sed -n '/case --amp/,$p' || true
    return $status
}

# Before and after: `.gpu/tcc-base` (a release `tcc` with CUDA support built from an earlier
# commit, copied there by hand) against `.gpu/tcc`, on the examples and the bench programs
# of issue 27, run alternately (ABAB) so both see the same clocks. Prints the device step time
# and the session's memory of each.
device_ab() {
    local log="$OUT/log" status=0 a
    mkdir -p "$log"
    [ -x "$OUT/tcc-base" ] || { echo "no $OUT/tcc-base"; return 2; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    local progs="examples/mlp.tdsl examples/cnn.tdsl examples/gpt.tdsl bench/rnn_chain.tdsl bench/unet_skip.tdsl bench/gelu.tdsl"
    for f in $progs; do
        local m; m=$(basename "$f" .tdsl)
        for v in base new; do
            local T="$OUT/tcc"; [ $v = base ] && T="$OUT/tcc-base"
            "$T" build "$f" --target cuda --emit artifact -o "$OUT/ab-$m-$v.tcc" ${AB_FLAGS:-} 2>>"$log/build-ab.txt" || status=1
        done
    done
    for round in $(seq 1 "${AB_ROUNDS:-2}"); do
        for f in $progs; do
            local m; m=$(basename "$f" .tdsl)
            for v in base new; do
                local T="$OUT/tcc"; [ $v = base ] && T="$OUT/tcc-base"
                "$T" run "$OUT/ab-$m-$v.tcc" --steps 20 --every 100 >"$log/ab-$m-$v.txt" 2>&1 || status=1
                echo "round $round $m $v: $(grep -E 'device step time|device memory of' "$log/ab-$m-$v.txt" | sed -E 's/\(CUDA events.*step\)://; s/\(arena.*//' | tr '\n' ' ')"
            done
        done
    done
    return $status
}

# `--mem-budget` against PyTorch's per-block checkpointing (issue 27): PyTorch eager and
# checkpointed (bench/torch_bench.py, modes eager and ckpt) on each model, then tcc built
# plainly and with `--mem-budget` set so that its whole session (arena + runtime) fits in
# PyTorch's checkpointed peak. Prints each one's step time and memory, and the time each
# adds to its own plain step. Carry .gpu/tcc.
device_ckpt() {
    local log="$OUT/log" status=0 m line budget
    mkdir -p "$log"
    nvidia-smi --query-gpu=name --format=csv,noheader
    python3 bench/torch_bench.py --cases "${CKPT_MODELS:-gpt,cnn,mlp}" --modes eager,ckpt \
        --json "$log/torch-ckpt.json" >"$log/torch-ckpt.txt" 2>&1 || status=1
    sed -n '/## results/,$p' "$log/torch-ckpt.txt"
    for m in $(echo "${CKPT_MODELS:-gpt,cnn,mlp}" | tr ',' ' '); do
        "$OUT/tcc" run "examples/$m.tdsl" --target cuda --steps 20 --every 100 >"$log/ckpt-$m-plain.txt" 2>&1 || status=1
        # The budget (MiB): PyTorch's checkpointed peak less tcc's runtime memory.
        budget=$(python3 - "$log/torch-ckpt.json" "$m" "$log/ckpt-$m-plain.txt" <<'PY'
import json, re, sys
runs = json.load(open(sys.argv[1]))["runs"]
peak = next(r["peak_alloc_mib"] for r in runs if r["case"] == sys.argv[2] and r["mode"] == "ckpt")
unit = {"B": 1 / 2**20, "KiB": 1 / 1024, "MiB": 1, "GiB": 1024}
text = open(sys.argv[3]).read()
m = re.search(r"runtime ([0-9.]+) (B|KiB|MiB|GiB)", text)
print(int(peak - float(m.group(1)) * unit[m.group(2)]))
PY
) || { echo "$m: no budget"; status=1; continue; }
        "$OUT/tcc" run "examples/$m.tdsl" --target cuda --mem-budget "${budget}MiB" --steps 20 --every 100 >"$log/ckpt-$m-budget.txt" 2>&1 || status=1
        for v in plain budget; do
            line=$(grep -E 'device step time|device memory of' "$log/ckpt-$m-$v.txt" | sed -E 's/\(CUDA events.*step\)://; s/\(measured.*//' | tr '\n' ' ')
            echo "tcc $m $v$([ $v = budget ] && echo " (--mem-budget ${budget}MiB)"): $line"
        done
        grep -E "^remat:|error" "$log/ckpt-$m-budget.txt" | head -3
    done
    return $status
}

# Data parallelism (`--gpus N`, issue 31): the NCCL tests of the GPU test binary (one rank on
# any machine; every GPU of a machine with 2 or more), then gpt and mlp on 1 and N GPUs
# (B per GPU as in examples/; on N also with --zero 1) beside PyTorch DDP and ZeroRedundancyOptimizer launched
# with torchrun (bench/ddp.py). Carry .gpu/tcc and .gpu/gpu-tests.
device_dp() {
    local log="$OUT/log" status=0 n
    mkdir -p "$log"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    n=$(nvidia-smi -L | wc -l)
    echo "== NCCL tests ($n GPUs)"
    if TCC_REQUIRE_GPU=1 "$OUT/gpu-tests" --test-threads 1 --nocapture nccl >"$log/dp-tests.txt" 2>&1; then
        echo "ok"
    else
        echo "FAIL"; status=1
    fi
    grep -E "rel err|^test |test result|panicked|skipped" "$log/dp-tests.txt"
    for m in ${DP_MODELS:-gpt cnn mlp}; do
        echo "== $m: tcc on 1 GPU, then on $n"
        "$OUT/tcc" run "examples/$m.tdsl" --target cuda --steps 20 --every 100 >"$log/dp-$m-1.txt" 2>&1 || status=1
        grep -E "step time|device memory of this session|arena" "$log/dp-$m-1.txt"
        if [ "$n" -ge 2 ]; then
            "$OUT/tcc" run "examples/$m.tdsl" --target cuda --gpus "$n" --steps 20 --every 100 >"$log/dp-$m-$n.txt" 2>&1 || status=1
            grep -E "step time|device memory of rank|arena|error" "$log/dp-$m-$n.txt"
            echo "-- $m: tcc on $n GPUs, ZeRO-1"
            "$OUT/tcc" run "examples/$m.tdsl" --target cuda --gpus "$n" --zero 1 --steps 20 --every 100 >"$log/dp-$m-$n-zero.txt" 2>&1 || status=1
            grep -E "step time|device memory of rank|arena|error" "$log/dp-$m-$n-zero.txt"
            "$OUT/tcc" mem "examples/$m.tdsl" --target cuda --gpus "$n" --zero 1 2>&1 | grep -E "model states|arena, fused" || status=1
        fi
        echo "== $m: PyTorch DDP (torchrun)"
        for w in 1 $([ "$n" -ge 2 ] && echo "$n"); do
            torchrun --standalone --nproc-per-node "$w" bench/ddp.py --model "$m" 2>"$log/ddp-$m-$w.err" | tail -1 || status=1
            torchrun --standalone --nproc-per-node "$w" bench/ddp.py --model "$m" --zero 2>"$log/ddp-$m-$w-zero.err" | tail -1 || status=1
        done
    done
    return $status
}

# Time to first step (issue 29): each example built with its PTX only and with SASS (`ptxas`
# of the machine's CUDA, on every core), then run for one step with the driver's JIT cache
# off (CUDA_CACHE_DISABLE=1, as on a fresh machine). Prints the build time and size, where
# the kernels came from, the load time `tcc run` reports and the wall time to step 1.
device_load() {
    local log="$OUT/log" status=0 m v s e
    mkdir -p "$log"
    nvidia-smi --query-gpu=name --format=csv,noheader
    for m in ${LOAD_MODELS:-tiny mlp cnn gpt}; do
        for v in ptx sass; do
            local flag="--sass=off"; [ $v = sass ] && flag="--sass=on"
            s=$(date +%s%N)
            "$OUT/tcc" build "examples/$m.tdsl" --target cuda "$flag" -o "$OUT/load-$m-$v.tcc" 2>"$log/load-build-$m-$v.txt" || status=1
            e=$(date +%s%N)
            echo "$m $v: built in $(( (e - s) / 1000000 )) ms, $(stat -c %s "$OUT/load-$m-$v.tcc") bytes $(grep -E '^sass:' "$log/load-build-$m-$v.txt")"
            s=$(date +%s%N)
            CUDA_CACHE_DISABLE=1 "$OUT/tcc" run "$OUT/load-$m-$v.tcc" --steps 1 >"$log/load-run-$m-$v.txt" 2>&1 || status=1
            e=$(date +%s%N)
            echo "$m $v: wall to step 1 $(( (e - s) / 1000000 )) ms; $(grep -E 'loaded on' "$log/load-run-$m-$v.txt" | sed -E 's/; arena.*//')"
            grep -E "^step +1|error" "$log/load-run-$m-$v.txt" | head -2
        done
    done
    return $status
}

case "$mode" in
    build) build ;;
    device-load) device_load ;;
    device-dp) device_dp ;;
    device-ab) device_ab ;;
    device-ckpt) device_ckpt ;;
    device-amp) device_amp ;;
    device-onnx) device_onnx ;;
    device) device all ;;
    device-tests) device tests ;;
    device-fuzz) device_fuzz ;;
    device-bench) device bench ;;
    auto)
        if command -v cargo >/dev/null; then build; fi
        if command -v nvidia-smi >/dev/null; then device; fi ;;
    *) echo "usage: scripts/gpu-check.sh [build|device|device-tests|device-bench|device-amp|device-onnx|device-ab|device-ckpt|device-dp|device-load|device-fuzz]"; exit 2 ;;
esac
