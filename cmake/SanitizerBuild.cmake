# The AddressSanitizer + UndefinedBehaviorSanitizer build (MHA_SANITIZE, `make test-asan`): a test tree,
# built and run on the machine that runs its tests, never installed.
#
# - Compiled at -O1 with line tables (-g1), as ASan's documentation advises: at -O0 the library's
#   accessors and kernels ran 5-10x slower and the suite spent minutes in them; -O1 keeps every check
#   (ASan instruments each memory access, UBSan each operation) and stack traces keep file:line.
# - Highway's dispatching kernels are compiled for the target this machine runs (and the static
#   baseline, always there) instead of every x86 target: the suite only ever runs the best target the
#   CPU has, so the others were compiled and never executed. The Release build (`make build`) still
#   compiles every target.
# GCC's -Wmaybe-uninitialized is unreliable with ASan's instrumentation (it flagged std::regex's own
# state 64 times at -O1); the Release build keeps the warning.
# MHA_SANITIZE_THREAD instead: ThreadSanitizer (`make test-tsan`), same optimisation and targets.
if(MHA_SANITIZE_THREAD)
  set(mha_sanitizers thread)
else()
  set(mha_sanitizers address,undefined)
endif()
add_compile_options(-fsanitize=${mha_sanitizers} -fno-sanitize-recover=all -fno-omit-frame-pointer -O1 -g1
                    -Wno-maybe-uninitialized)
add_link_options(-fsanitize=${mha_sanitizers})

try_run(mha_hwy_run mha_hwy_compiled ${CMAKE_BINARY_DIR}/hwy_machine_target
        SOURCES ${CMAKE_CURRENT_LIST_DIR}/hwy_machine_target.cpp
        LINK_LIBRARIES hwy::hwy CXX_STANDARD 20
        RUN_OUTPUT_VARIABLE mha_hwy_best)
if(mha_hwy_compiled AND mha_hwy_run EQUAL 0 AND mha_hwy_best MATCHES "^[0-9]+$")
  # Every x86 target Highway 1.0 may compile, less the machine's best.
  add_compile_definitions("HWY_DISABLED_TARGETS=((HWY_SSSE3|HWY_SSE4|HWY_AVX2|HWY_AVX3|HWY_AVX3_DL)&~${mha_hwy_best}LL)")
  message(STATUS "Sanitizer build: Highway kernels compiled for this machine's target (bit ${mha_hwy_best}) only")
else()
  message(STATUS "Sanitizer build: could not ask Highway for this machine's target; compiling every target")
endif()
