# Runs the `rpe` tool and checks its exit status and error message (a CTest script, label cli).
#   cmake -DRPE=<path of rpe> -DARGS="buckets|--bogus" -DEXIT=2 -DMATCH=<regex of stderr> -P expect_exit.cmake
# ARGS separates the arguments with '|' (a ';' would be split by add_test).
string(REPLACE "|" ";" _args "${ARGS}")
execute_process(COMMAND "${RPE}" ${_args} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
if(NOT _rc STREQUAL "${EXIT}")
  message(FATAL_ERROR "rpe ${_args}: exit status ${_rc}, expected ${EXIT}\nstdout: ${_out}\nstderr: ${_err}")
endif()
if(NOT _err MATCHES "${MATCH}")
  message(FATAL_ERROR "rpe ${_args}: stderr does not match '${MATCH}':\n${_err}")
endif()
message(STATUS "rpe ${_args}: exit ${_rc} as expected; stderr: ${_err}")
