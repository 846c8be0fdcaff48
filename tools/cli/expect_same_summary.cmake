# Runs the `rpe` tool twice and checks that both succeed and print the same bucket summary (the
# lines "num_buckets = ...", "buckets used: ..." of `rpe buckets`, CTest script, label cli).
#   cmake -DRPE=<path of rpe> -DARGS_A="buckets|--grid|3x4" -DARGS_B="buckets|--positions|P.npy"
#         -DMATCH=<regex of both summaries, their lines joined by " | "> -P expect_same_summary.cmake
# ARGS_A and ARGS_B separate the arguments with '|' (a ';' would be split by add_test).
foreach(_run A B)
  string(REPLACE "|" ";" _args "${ARGS_${_run}}")
  execute_process(COMMAND "${RPE}" ${_args} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
  if(NOT _rc STREQUAL "0")
    message(FATAL_ERROR "rpe ${_args}: exit status ${_rc}, expected 0\nstdout: ${_out}\nstderr: ${_err}")
  endif()
  string(REGEX MATCHALL "(num_buckets = |buckets used: )[^\n]*" _summary_${_run} "${_out}")
  list(JOIN _summary_${_run} " | " _summary_${_run})  # one line (MATCH may not hold a ';')
  if(NOT _summary_${_run} OR NOT "${_summary_${_run}}" MATCHES "${MATCH}")
    message(FATAL_ERROR "rpe ${_args}: the summary '${_summary_${_run}}' does not match '${MATCH}'\nstdout: ${_out}")
  endif()
endforeach()
if(NOT _summary_A STREQUAL _summary_B)
  message(FATAL_ERROR "the summaries differ:\n  ${ARGS_A}: ${_summary_A}\n  ${ARGS_B}: ${_summary_B}")
endif()
message(STATUS "same summary: ${_summary_A}")
