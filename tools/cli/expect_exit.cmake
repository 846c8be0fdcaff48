# Runs the `rpe` tool and checks its exit status and error message (a CTest script, label cli).
#   cmake -DRPE=<path of rpe> -DARGS="buckets|--bogus" -DEXIT=2 -DMATCH=<regex of stderr>
#         [-DOUT_MATCH=<regex of stdout>] -P expect_exit.cmake
# ARGS separates the arguments with '|' (a ';' would be split by add_test).
string(REPLACE "|" ";" _args "${ARGS}")
execute_process(COMMAND "${RPE}" ${_args} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
if(NOT _rc STREQUAL "${EXIT}")
  message(FATAL_ERROR "rpe ${_args}: exit status ${_rc}, expected ${EXIT}\nstdout: ${_out}\nstderr: ${_err}")
endif()
if(NOT _err MATCHES "${MATCH}")
  message(FATAL_ERROR "rpe ${_args}: stderr does not match '${MATCH}':\n${_err}")
endif()
if(DEFINED OUT_MATCH AND NOT _out MATCHES "${OUT_MATCH}")
  message(FATAL_ERROR "rpe ${_args}: stdout does not match '${OUT_MATCH}':\n${_out}")
endif()
message(STATUS "rpe ${_args}: exit ${_rc} as expected; stderr: ${_err}")
