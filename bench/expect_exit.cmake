# Runs rpe_bench with RPE_BENCH_PLUGINS set and checks that it fails: a non-zero exit status and
# an error message (a CTest script, label bench).
#   cmake -DBENCH=<path of rpe_bench> -DPLUGINS=<RPE_BENCH_PLUGINS value> -DMATCH=<regex of stderr>
#         -P expect_exit.cmake
set(ENV{RPE_BENCH_PLUGINS} "${PLUGINS}")
execute_process(COMMAND "${BENCH}" --benchmark_list_tests=true RESULT_VARIABLE _rc OUTPUT_VARIABLE _out
                ERROR_VARIABLE _err)
if(_rc STREQUAL "0" OR NOT _rc MATCHES "^[0-9]+$")
  message(FATAL_ERROR "RPE_BENCH_PLUGINS=${PLUGINS} rpe_bench: exit status '${_rc}', expected a non-zero status\n"
                      "stderr: ${_err}")
endif()
if(NOT _err MATCHES "${MATCH}")
  message(FATAL_ERROR "RPE_BENCH_PLUGINS=${PLUGINS} rpe_bench: stderr does not match '${MATCH}':\n${_err}")
endif()
message(STATUS "RPE_BENCH_PLUGINS=${PLUGINS} rpe_bench: exit ${_rc} as expected; stderr: ${_err}")
