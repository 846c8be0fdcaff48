# Run by CTest (test format.clang_format): every C++ and CUDA source of the repository is formatted
# as .clang-format says, with the clang-format 14 that scripts/test.sh installs (another major
# version formats some constructs differently, so the test is only registered for 14).
#   cmake -DCLANG_FORMAT=<clang-format-14> -DROOT=<repo> -P check_format.cmake
# Fails naming each file that clang-format would change; `clang-format -i FILE` fixes it.
foreach(var CLANG_FORMAT ROOT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_format.cmake: -D${var}=... is required")
  endif()
endforeach()
set(files "")
foreach(dir bench bindings examples fuzz include src tests tools)
  file(GLOB_RECURSE found "${ROOT}/${dir}/*.hpp" "${ROOT}/${dir}/*.cpp" "${ROOT}/${dir}/*.cuh" "${ROOT}/${dir}/*.cu"
       "${ROOT}/${dir}/*.h")
  list(APPEND files ${found})
endforeach()
list(LENGTH files count)
if(count LESS 50)
  message(FATAL_ERROR "check_format.cmake: found ${count} sources under ${ROOT}; expected the repository's (over 100)")
endif()
set(unformatted "")
foreach(file IN LISTS files)
  # the formatted text against the file (not --dry-run --Werror: clang-format 14 reports a no-op
  # replacement of a doctest TEST_SUITE's closing comment as a violation)
  execute_process(COMMAND "${CLANG_FORMAT}" "${file}" RESULT_VARIABLE rc OUTPUT_VARIABLE formatted ERROR_VARIABLE err)
  file(READ "${file}" text)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${CLANG_FORMAT} failed on ${file} (exit ${rc}): ${err}")
  endif()
  if(NOT formatted STREQUAL text)
    file(RELATIVE_PATH rel "${ROOT}" "${file}")
    list(APPEND unformatted "${rel}")
  endif()
endforeach()
if(unformatted)
  list(JOIN unformatted "\n  " shown)
  message(FATAL_ERROR "not formatted as .clang-format says (fix with clang-format -i):\n  ${shown}")
endif()
message(STATUS "${count} sources formatted as .clang-format says")
