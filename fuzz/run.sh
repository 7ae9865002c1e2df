#!/usr/bin/env bash
# fuzz/run.sh — runs one fuzz harness and prints its figures (what `make fuzz` calls).
#
#   fuzz/run.sh cpp   libFuzzer over lab::ModelFile::open + lab::Model::load (build/fuzz/model_file_fuzzer)
#   fuzz/run.sh py    atheris over lab.models.export.read (fuzz/read_fuzzer.py)
#
# Inputs: the harness's own corpus ($FUZZ_DIR/corpus-<harness>, grown across runs), the seed
# corpus ($FUZZ_DIR/seeds, from fuzz/seeds.py) and fuzz/crashes/ (inputs that crashed
# before: each is a regression input once its bug is fixed). One process, no -jobs/-workers.
#
# Environment (the Makefile passes its variables of the same names):
#   FUZZ_DIR      build folder (build/fuzz)
#   FUZZ_SECONDS  run time when FUZZ_RUNS is empty (30)
#   FUZZ_RUNS     run exactly this many inputs instead (the long run: 1000000)
#   FUZZ_TIMEOUT  seconds one input may take before it counts as a hang (25)
#   FUZZ_ARGS     more libFuzzer flags, e.g. "-seed=1 -max_len=200000"
#   PY            the Python with lab and atheris installed (.venv/bin/python)
# The log is $FUZZ_DIR/<harness>.log; a crashing input goes to $FUZZ_DIR/artifacts/<harness>/.
# Exit status: the fuzzer's (0: no crash).
set -uo pipefail
cd "$(dirname "$0")/.."
which=${1:?usage: fuzz/run.sh cpp|py}
FUZZ_DIR=${FUZZ_DIR:-build/fuzz}
corpus=$FUZZ_DIR/corpus-$which
art=$FUZZ_DIR/artifacts/$which
log=$FUZZ_DIR/$which.log
mkdir -p "$corpus" "$art" "$FUZZ_DIR/seeds" fuzz/crashes
case $which in
    cpp) cmd=("$FUZZ_DIR/model_file_fuzzer") ;;
    py)  cmd=("${PY:-.venv/bin/python}" fuzz/read_fuzzer.py) ;;
    *)   echo "fuzz/run.sh: unknown harness '$which' (cpp or py)" >&2; exit 2 ;;
esac
if [ -n "${FUZZ_RUNS:-}" ]; then limit=(-runs="$FUZZ_RUNS"); what="$FUZZ_RUNS inputs"
else limit=(-max_total_time="${FUZZ_SECONDS:-30}"); what="${FUZZ_SECONDS:-30} s"; fi
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

echo "fuzz $which: ${cmd[*]} ($what; log $log)"
start=$(date +%s.%N)
# shellcheck disable=SC2086  # FUZZ_ARGS is a list of flags
"${cmd[@]}" "${limit[@]}" -print_final_stats=1 -timeout="${FUZZ_TIMEOUT:-25}" \
    -artifact_prefix="$art/" ${FUZZ_ARGS:-} "$corpus" "$FUZZ_DIR/seeds" fuzz/crashes >"$log" 2>&1
rc=$?
wall=$(echo "$start $(date +%s.%N)" | awk '{printf "%.0f", $2 - $1}')

stat() { sed -n "s/^stat::$1: *//p" "$log" | tail -1; }
last=$(grep -E '^#[0-9]+[[:space:]].* cov: ' "$log" | tail -1)
cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
corp=$(sed -n 's/.* corp: \([0-9]*\/[0-9]*[a-zA-Z]*\).*/\1/p' <<<"$last")
runs=$(stat number_of_executed_units)
[ -n "$runs" ] || runs=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$log" | tail -1)
[ -n "$runs" ] || runs=$(sed -n 's/^#\([0-9]*\) .*/\1/p' "$log" | tail -1)
files=$(find "$corpus" -type f | wc -l)
bytes=$(du -sb "$corpus" | cut -f1)
echo "fuzz $which: ${runs:-?} inputs in ${wall} s ($(stat average_exec_per_sec) /s), cov ${cov:-?} ft ${ft:-?}," \
     "corpus ${corp:-?} (in the run; $files files / $bytes bytes in $corpus), peak rss $(stat peak_rss_mb) MB, exit $rc"
if [ "$rc" -ne 0 ]; then
    echo "fuzz $which: FAILED: $(grep -o 'Test unit written to .*' "$log" | tail -1 || echo "no input written; see $log")"
    echo "  (minimize it: ${cmd[*]} -minimize_crash=1 -max_total_time=60 -exact_artifact_path=fuzz/crashes/NAME.min INPUT)"
    # the report: from the sanitizer's or Python's first line to the end, at most 60 lines
    awk '/ERROR: (Address|Undefined|Leak)Sanitizer|runtime error:|=== Uncaught Python exception|^== read\(\)|ERROR: libFuzzer/ {p=1} p' \
        "$log" | head -60
fi
exit "$rc"
