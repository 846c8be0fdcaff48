# rpe_target_warnings(<target> [NO_WERROR])
#
# Settings of rpe's own test, tool, example and benchmark targets — never of rpe::rpe itself, so a
# consumer's flags stay the consumer's business:
# - strict warnings (Third-party headers — Eigen, doctest, benchmark, nlohmann_json — come in
#   through imported targets as system includes and do not trigger them);
# - with RPE_NATIVE (default ON when rpe is the top-level project), code for the building machine
#   (-march=native), so the CPU kernels take their AVX2/AVX-512 paths; the choice is passed to the
#   code as RPE_BUILD_MARCH ("native" or "default"), which the demo, the CLI and the benchmark JSON
#   print. rpe::rpe never adds ISA flags: a consumer compiles rpe with their own.
include_guard(GLOBAL)

option(RPE_NATIVE "Compile rpe's own tests, examples, CLI and benchmarks with -march=native" ${PROJECT_IS_TOP_LEVEL})
include(CheckCXXCompilerFlag)
check_cxx_compiler_flag(-march=native RPE_HAS_MARCH_NATIVE)
if(RPE_NATIVE AND NOT RPE_HAS_MARCH_NATIVE)
  message(STATUS "rpe: RPE_NATIVE=ON but the compiler does not take -march=native; building for its default ISA")
endif()
message(STATUS "  RPE_NATIVE=${RPE_NATIVE}")

function(rpe_target_warnings target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "NO_WERROR" "" "")
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic)
    if(NOT arg_NO_WERROR)
      target_compile_options(${target} PRIVATE -Werror)
    endif()
  elseif(MSVC)
    target_compile_options(${target} PRIVATE /W4 /permissive-)
    if(NOT arg_NO_WERROR)
      target_compile_options(${target} PRIVATE /WX)
    endif()
  endif()
  if(RPE_NATIVE AND RPE_HAS_MARCH_NATIVE)
    # No -Wno-maybe-uninitialized: rpe's headers are clean under -march=native (g++ 12's AVX-512
    # intrinsics false positives are handled in rpe/backend/cpu/eigen.hpp; test readme.strict_*).
    target_compile_options(${target} PRIVATE -march=native)
    target_compile_definitions(${target} PRIVATE RPE_BUILD_MARCH="native")
  else()
    target_compile_definitions(${target} PRIVATE RPE_BUILD_MARCH="default")
  endif()
endfunction()
