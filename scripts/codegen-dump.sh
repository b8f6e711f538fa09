#!/usr/bin/env bash
# Writes the kernel IR, CLIF, PTX and artifact hashes of every example and bench model into
# one folder, so that a refactor can show its code is byte-identical:
#
#   scripts/codegen-dump.sh OUT_BEFORE [TCC]     # at the old commit
#   scripts/codegen-dump.sh OUT_AFTER  [TCC]     # at the new one
#   diff -r OUT_BEFORE OUT_AFTER                 # nothing: same code, plans and artifacts
#
# TCC defaults to target/release/tcc (built first when cargo is present). The remat
# variants are the budgets `scripts/gpu-check.sh` benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/codegen-dump.sh OUT [TCC]}"
tcc="${2:-}"
if [ -z "$tcc" ]; then
    cargo build --release -q -p tcc
    tcc=target/release/tcc
fi
mkdir -p "$out"

# name, then the build flags.
cases=(
    "tiny|examples/tiny.tdsl"
    "mlp|examples/mlp.tdsl"
    "cnn|examples/cnn.tdsl"
    "gpt|examples/gpt.tdsl"
    "gpt-small|examples/gpt.tdsl --set L=2 --set D=64 --set H=2 --set T=64 --set B=2 --set V=128"
    "cnn-small|examples/cnn.tdsl --set B=4 --set C=16 --set S=16"
    "add|bench/add.tdsl"
    "gelu|bench/gelu.tdsl"
    "rnn_chain|bench/rnn_chain.tdsl"
    "unet_skip|bench/unet_skip.tdsl"
    "gemm_f32|bench/gemm_f32.tdsl"
    "gemm_bf16|bench/gemm_bf16.tdsl"
    "matmul_edges|bench/matmul_edges.tdsl"
    "conv_edges|bench/conv_edges.tdsl"
)
for c in "${cases[@]}"; do
    name="${c%%|*}"
    read -r -a args <<<"${c#*|}"
    "$tcc" build "${args[@]}" --emit ir >"$out/$name.ir" 2>/dev/null
    "$tcc" build "${args[@]}" --emit kernels >"$out/$name.cpu.kernels" 2>/dev/null
    "$tcc" build "${args[@]}" --emit clif >"$out/$name.clif" 2>/dev/null
    "$tcc" build "${args[@]}" --target cuda --emit kernels >"$out/$name.cuda.kernels" 2>/dev/null
    "$tcc" build "${args[@]}" --target cuda --emit ptx >"$out/$name.ptx" 2>/dev/null
    echo "$name"
done
for c in "gemm_f32" "matmul_edges"; do
    "$tcc" build "bench/$c.tdsl" --allow-tf32 --target cuda --emit ptx >"$out/$c.tf32.ptx" 2>/dev/null
done
"$tcc" build examples/cnn.tdsl --emit kernels --layout nhwc >"$out/cnn.nhwc.kernels" 2>/dev/null
"$tcc" build examples/mlp.tdsl --emit kernels --no-fuse >"$out/mlp.nofuse.kernels" 2>/dev/null
# Artifacts of the small models (plan, manifest, code and params): their hashes.
for c in "tiny|examples/tiny.tdsl" "mlp|examples/mlp.tdsl" "cnn-small|examples/cnn.tdsl --set B=4 --set C=16 --set S=16"; do
    name="${c%%|*}"
    read -r -a args <<<"${c#*|}"
    for t in cpu cuda; do
        "$tcc" build "${args[@]}" --target "$t" --emit artifact -o "$out/$name.$t.tcc" 2>/dev/null
        sha256sum "$out/$name.$t.tcc" | cut -d' ' -f1 >"$out/$name.$t.tcc.sha256"
        rm -f "$out/$name.$t.tcc"
    done
done
if [ "${DUMP_REMAT:-1}" = 1 ]; then
    "$tcc" build examples/cnn.tdsl --mem-budget 430MiB --target cuda --emit ptx >"$out/cnn-remat.ptx" 2>/dev/null
    "$tcc" build examples/gpt.tdsl --mem-budget 1.85GiB --target cuda --emit ptx >"$out/gpt-remat.ptx" 2>/dev/null
    echo "remat"
fi
echo "wrote $out"
