# Sanitizer and fuzzing builds (scripts/sanitizers, scripts/fuzz, .ci/run).
#
# COLLECTIVED_SANITIZE=address,undefined or thread instruments every target.
# Any report is fatal (-fno-sanitize-recover), so a test that triggers one fails.
if(COLLECTIVED_SANITIZE)
  set(_san -fsanitize=${COLLECTIVED_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  # C and C++ only: nvcc (engine/gpu kernels) takes no -fsanitize.
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${_san}>")
  add_link_options(${_san})
  # -O1 -g1 (after the build type's -O2 -g, so they win): line tables are all
  # a sanitizer report needs, and instrumented code at -O2 with full debug
  # information takes 2.5x as long to compile (daemon/session.cc: 110 s vs
  # 43 s with ASan+UBSan), which CI's 2 cores cannot afford twice.
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-O1;-g1>")
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # GCC 12's object-size warnings misfire on sanitizer-instrumented code
    # (a vector resize in bad_input_test: "bound 18446744073709551610").
    add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-Wno-stringop-overflow>)
  endif()
  if(COLLECTIVED_SANITIZE MATCHES "thread" AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # GCC warns that TSan does not understand std::atomic_thread_fence (Asio's
    # reactor uses one); the fence's ordering is still honoured by the runtime's
    # own happens-before tracking of the atomics around it.
    add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-Wno-tsan>)
  endif()
endif()

# COLLECTIVED_FUZZ=ON (clang): every library is built with libFuzzer's coverage
# instrumentation plus ASan and UBSan; tests/fuzz links the fuzz targets with
# -fsanitize=fuzzer. Build only the fuzz targets in such a tree (scripts/fuzz):
# libcollective.so would need the sanitizer runtime that clang links into
# executables only.
if(COLLECTIVED_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "COLLECTIVED_FUZZ=ON needs clang (CC=clang CXX=clang++): libFuzzer is part of clang")
  endif()
  set(COLLECTIVED_FUZZ_FLAGS -fsanitize=fuzzer-no-link,address,undefined
      -fno-sanitize-recover=all -fno-omit-frame-pointer)
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${COLLECTIVED_FUZZ_FLAGS}>")
  # -O1 -gline-tables-only, as OSS-Fuzz builds its targets: line tables are
  # all a crash report needs. CI's fuzz stage (build + 5 targets x 60 s, three
  # at a time) took 333-377 s with -O2 -g, 299 s with this.
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-O1;-gline-tables-only>")
  add_compile_definitions(COLLECTIVED_FUZZING=1)
endif()
