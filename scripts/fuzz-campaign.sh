#!/usr/bin/env bash
# Issue 32's campaign: the suite's no-panic property tests with more cases, from the suite's
# fixed seed (PROPTEST_RNG_SEED=<u64> for another): FRONT times the front end's (default
# 250: 1,000,000 random and mutated TDSL inputs), WHOLE times the whole pipeline's (default
# 100: 30,000 programs) and LOADER times the loader's (default 10: 30,000 edited artifact
# manifests). A case that panics fails its test and is saved in
# tests/tests/*.proptest-regressions.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
run() {
    local scale="$1" start rc
    shift
    start=$(date +%s)
    TCC_FUZZ_SCALE="$scale" cargo test -p tcc-tests "$@" >"${TMPDIR:-/tmp}/tcc-fuzz.log" 2>&1
    rc=$?
    grep -E "^test |test result|panicked|minimal failing|^error" "${TMPDIR:-/tmp}/tcc-fuzz.log"
    echo "-- scale $scale: $(( $(date +%s) - start )) s, exit $rc"
    return $rc
}
run "${FRONT:-250}" --test no_panic -- never_panic --skip anywhere || status=1
run "${WHOLE:-100}" --test no_panic -- anywhere || status=1
run "${LOADER:-10}" --test artifact_integrity -- edited_manifests || status=1
exit $status
