# Runs the `rpe` tool so that its output cannot be written, and checks that nothing half-written
# is left: the exit status, the message, and the folder's contents afterwards (a CTest script,
# label cli).
#   cmake -DRPE=<path of rpe> -DDIR=<scratch folder, emptied first> -DARGS="buckets|--out|f.npy"
#         -DTARGET=f.npy [-DOLD=<content of an existing target>] [-DLIMIT=<ulimit -f, 512-byte blocks>]
#         -DEXIT=1 -DMATCH=<regex of stderr> -P expect_no_partial.cmake
# The command runs in DIR. With LIMIT it runs under `ulimit -f LIMIT` (SIGXFSZ not ignored by
# the shell: the tool must ignore it itself). Afterwards DIR must hold TARGET with content OLD
# when OLD is given, and nothing at all otherwise (no partial target, no temporary file).
string(REPLACE "|" ";" _args "${ARGS}")
file(REMOVE_RECURSE "${DIR}")
file(MAKE_DIRECTORY "${DIR}")
if(DEFINED OLD)
  file(WRITE "${DIR}/${TARGET}" "${OLD}")
endif()
if(DEFINED LIMIT)
  execute_process(COMMAND /bin/sh -c "ulimit -f ${LIMIT} && exec \"$@\"" sh "${RPE}" ${_args}
                  WORKING_DIRECTORY "${DIR}" RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
else()
  execute_process(COMMAND "${RPE}" ${_args}
                  WORKING_DIRECTORY "${DIR}" RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
endif()
if(NOT _rc STREQUAL "${EXIT}")
  message(FATAL_ERROR "rpe ${_args}: exit status ${_rc}, expected ${EXIT}\nstdout: ${_out}\nstderr: ${_err}")
endif()
if(NOT _err MATCHES "${MATCH}")
  message(FATAL_ERROR "rpe ${_args}: stderr does not match '${MATCH}':\n${_err}")
endif()
file(GLOB_RECURSE _left RELATIVE "${DIR}" LIST_DIRECTORIES true "${DIR}/*")
if(DEFINED OLD)
  if(NOT _left STREQUAL "${TARGET}")
    message(FATAL_ERROR "rpe ${_args}: ${DIR} holds '${_left}'; expected only ${TARGET}")
  endif()
  file(READ "${DIR}/${TARGET}" _now)
  if(NOT _now STREQUAL "${OLD}")
    message(FATAL_ERROR "rpe ${_args}: ${TARGET} changed to '${_now}'; expected '${OLD}'")
  endif()
elseif(_left)
  message(FATAL_ERROR "rpe ${_args}: ${DIR} holds '${_left}'; expected nothing (a partial or temporary file)")
endif()
message(STATUS "rpe ${_args}: exit ${_rc} as expected, nothing half-written; stderr: ${_err}")
