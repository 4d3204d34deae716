#!/usr/bin/env bash
# Builds the libFuzzer targets of the file readers and runs each for a bounded time.
#
#   fuzz/run.sh [safetensors|npy ...]       both targets when none is named
#
# Environment: FUZZ_TIME seconds per target (default 30), FUZZ_BUILD output folder (default
# build-fuzz), CXX (default clang++-14), FUZZ_ARGS extra libFuzzer flags (e.g. -jobs=2).
#
# The targets are built with clang's libFuzzer, AddressSanitizer (which also detects leaks) and
# UndefinedBehaviorSanitizer, from the readers' sources only (src/io, src/tensor.cpp and what it uses: the
# tensor storage, src/storage_cache.cpp, run with its cache off so that ASan sees every freed block, and the
# bfloat16 conversions of src/bf16_conversion.cpp, linked to Highway): no oneDNN, no OpenMP. Limits: inputs up to 64 KiB (-max_len), and no single allocation of 1 MiB or more
# (-malloc_limit_mb=1). Readers may allocate what the input holds, widened at most 2x (F16 -> float32)
# plus container slack, which stays far below 1 MiB for a 64 KiB input; a size the file merely
# claims (10^18 elements) would go far above it and be reported as a crash. Exits non-zero when a
# target finds anything (crash, sanitizer report, leak, over-limit allocation, timeout); the input is
# saved under $FUZZ_BUILD/artifacts/. New inputs go to $FUZZ_BUILD/corpus/<target>; the committed
# seeds in fuzz/corpus/<target> are only read.
set -euo pipefail
cd "$(dirname "$0")/.."

CXX=${CXX:-clang++-14}
FUZZ_TIME=${FUZZ_TIME:-30}
OUT=${FUZZ_BUILD:-build-fuzz}
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(safetensors npy)

if ! command -v "$CXX" >/dev/null 2>&1; then
  echo "fuzz/run.sh: $CXX not found (Debian: apt-get install clang-14 libclang-rt-14-dev)" >&2
  exit 1
fi

sources=(src/io/safetensors.cpp src/io/npy.cpp src/io/binary_file.cpp src/io/tensor_bytes.cpp src/tensor.cpp
         src/storage_cache.cpp src/bf16_conversion.cpp)
flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer
       -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
       -Iinclude -Isrc)
mkdir -p "$OUT/artifacts"

build() {  # build <target>: the fuzzer binary, from its entry point and the readers' sources
  "$CXX" "${flags[@]}" "fuzz/${1}_fuzzer.cpp" "${sources[@]}" -lhwy -o "$OUT/${1}_fuzzer" >"$OUT/$1-build.log" 2>&1
}

fuzz() {  # fuzz <target>: runs it for FUZZ_TIME seconds, its output in $OUT/<target>.log
  mkdir -p "$OUT/corpus/$1"
  MHA_STORAGE_CACHE_MIB=0 ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=0 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$OUT/${1}_fuzzer" -max_total_time="$FUZZ_TIME" -rss_limit_mb=2048 -malloc_limit_mb=1 -max_len=65536 \
    -timeout=10 -print_final_stats=1 -dict="fuzz/$1.dict" -artifact_prefix="$OUT/artifacts/$1-" \
    ${FUZZ_ARGS:-} "$OUT/corpus/$1" "fuzz/corpus/$1" >"$OUT/$1.log" 2>&1
}

# each_target <step>: runs the step for every target, side by side when the machine has a core for each
# (each build and each fuzzer is one process on one core; FUZZ_TIME stays each target's own time), and
# sets rc_<target> to each one's exit status.
each_target() {
  local t pids=()
  if [ "$(nproc)" -ge ${#targets[@]} ]; then
    for t in "${targets[@]}"; do "$1" "$t" & pids+=($!); done
    for i in "${!targets[@]}"; do
      set +e; wait "${pids[$i]}"; printf -v "rc_${targets[$i]}" '%d' $?; set -e
    done
  else
    for t in "${targets[@]}"; do set +e; "$1" "$t"; printf -v "rc_$t" '%d' $?; set -e; done
  fi
}

status=0
echo "== building ${targets[*]}"
each_target build
for t in "${targets[@]}"; do
  rc_var="rc_$t"
  if [ "${!rc_var}" -ne 0 ]; then
    echo "== $t: build FAILED" >&2; cat "$OUT/$t-build.log" >&2; exit 1
  fi
done
echo "== fuzzing ${targets[*]} for ${FUZZ_TIME} s each"
each_target fuzz
for t in "${targets[@]}"; do
  rc_var="rc_$t"
  rc=${!rc_var}
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$OUT/$t.log" | tail -1 | awk '{print $2}')
  speed=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$OUT/$t.log" | tail -1 | awk '{print $2}')
  cov=$(grep -o 'cov: [0-9]*' "$OUT/$t.log" | tail -1 | awk '{print $2}')
  if [ "$rc" -ne 0 ]; then
    echo "== $t: FAILED (exit $rc); log: $OUT/$t.log" >&2
    tail -40 "$OUT/$t.log" >&2
    status=1
  else
    echo "== $t: ok, ${runs:-?} runs, ${speed:-?} exec/s, coverage ${cov:-?} edges, ${FUZZ_TIME} s"
  fi
done
exit $status
