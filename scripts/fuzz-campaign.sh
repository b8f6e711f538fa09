#!/usr/bin/env bash
# Issue 32's campaign: the suite's no-panic property tests with more cases, from the suite's
# fixed seed (PROPTEST_RNG_SEED=<u64> for another): FRONT times the front end's (default
# 250: 1,000,000 random and mutated TDSL inputs), WHOLE times the whole pipeline's (default
# 100: 30,000 programs) and LOADER times the loader's (default 10: 30,000 edited artifact
# manifests). A case that panics fails its test and is saved in
# tests/tests/*.proptest-regressions.
set -uo pipefail
cd "$(dirname "$0")/.."
run() {
    local scale="$1" start
    shift
    start=$(date +%s)
    TCC_FUZZ_SCALE="$scale" cargo test -p tcc-tests "$@" 2>&1 \
        | grep -E "^test |test result|panicked|minimal failing"
    echo "-- scale $scale: $(( $(date +%s) - start )) s"
}
run "${FRONT:-250}" --test no_panic -- never_panic --skip anywhere
run "${WHOLE:-100}" --test no_panic -- anywhere
run "${LOADER:-10}" --test artifact_integrity -- edited_manifests
