# rpeDoctestAddTests.cmake — a drop-in replacement for doctest 2.4.9's doctestAddTests.cmake, the
# script that doctest_discover_tests() runs after each build of a test executable to write one
# CTest test per TEST_CASE. tests/CMakeLists.txt points doctest at it through
# _DOCTEST_DISCOVER_TESTS_SCRIPT. It takes the same -D variables as the original and fixes:
#   * test names with an unbalanced '[' (e.g. "ids outside [0, num_buckets)"): the original splits
#     the listing as a CMake list, where '[' ... ']' suppresses ';' splitting, so every later name
#     was glued into one bogus test ("set_tests_properties unknown error");
#   * test names with ';' were cut in two, and the halves ran with a filter matching nothing;
#   * `PROPERTIES LABELS x` was overwritten by the empty `LABELS` the original appends;
#   * a test whose filter matches no test case passed (doctest exits 0): each test now fails when
#     doctest reports "test cases: 0".
# Names are written as bracket arguments; in the --test-case filter ',' is escaped as '\,' and
# ';' becomes the wildcard '?', so the filter still matches exactly that test case.
cmake_minimum_required(VERSION 3.25)

set(prefix "${TEST_PREFIX}")
set(suffix "${TEST_SUFFIX}")

if(NOT EXISTS "${TEST_EXECUTABLE}")
  message(FATAL_ERROR "Specified test executable '${TEST_EXECUTABLE}' does not exist")
endif()

set(spec_args "")
if(NOT "${TEST_SPEC}" STREQUAL "")
  set(spec_args "--test-case=${TEST_SPEC}")
endif()

execute_process(
  COMMAND ${TEST_EXECUTOR} "${TEST_EXECUTABLE}" ${spec_args} --list-test-cases
  OUTPUT_VARIABLE output
  RESULT_VARIABLE result
  WORKING_DIRECTORY "${TEST_WORKING_DIR}")
if(NOT result EQUAL 0)
  message(FATAL_ERROR "Error running test executable '${TEST_EXECUTABLE}':\n"
                      "  Result: ${result}\n  Output: ${output}\n")
endif()

# Hide the characters that CMake's list handling treats specially, split into lines, restore.
string(ASCII 1 _lb)
string(ASCII 2 _rb)
string(ASCII 3 _sc)
string(ASCII 4 _bs)
string(REPLACE "\\" "${_bs}" output "${output}")
string(REPLACE "[" "${_lb}" output "${output}")
string(REPLACE "]" "${_rb}" output "${output}")
string(REPLACE ";" "${_sc}" output "${output}")
string(REPLACE "\r" "" output "${output}")
string(REPLACE "\n" ";" lines "${output}")

# Returns in out_var the text as a bracket argument whose '=' count does not occur inside it.
function(rpe_bracket text out_var)
  set(eq "==")
  while(text MATCHES "\\]${eq}\\]")
    string(APPEND eq "=")
  endwhile()
  set(${out_var} "[${eq}[${text}]${eq}]" PARENT_SCOPE)
endfunction()

set(extra_args_text "")
foreach(arg IN LISTS TEST_EXTRA_ARGS)
  rpe_bracket("${arg}" quoted)
  string(APPEND extra_args_text " ${quoted}")
endforeach()
set(properties_text "")
foreach(item IN LISTS TEST_PROPERTIES)
  rpe_bracket("${item}" quoted)
  string(APPEND properties_text " ${quoted}")
endforeach()
rpe_bracket("${TEST_EXECUTABLE}" exe_text)
rpe_bracket("${TEST_WORKING_DIR}" wd_text)
set(executor_text "")
foreach(arg IN LISTS TEST_EXECUTOR)
  rpe_bracket("${arg}" quoted)
  string(APPEND executor_text " ${quoted}")
endforeach()

set(script "")
set(tests_text "")
foreach(line IN LISTS lines)
  if(line STREQUAL "" OR line MATCHES "^=+$")
    continue()
  endif()
  string(FIND "${line}" "${_lb}doctest${_rb} " at)
  if(at EQUAL 0)
    continue()
  endif()
  # The doctest filter: ',' separates filters (escape it), ';' is matched by the wildcard '?'.
  set(filter "${line}")
  string(REPLACE "," "\\," filter "${filter}")
  string(REPLACE "${_sc}" "?" filter "${filter}")
  set(name "${prefix}${line}${suffix}")
  foreach(var IN ITEMS name filter)
    string(REPLACE "${_bs}" "\\" ${var} "${${var}}")
    string(REPLACE "${_lb}" "[" ${var} "${${var}}")
    string(REPLACE "${_rb}" "]" ${var} "${${var}}")
    string(REPLACE "${_sc}" ";" ${var} "${${var}}")
  endforeach()

  set(junit_text "")
  if(NOT "${TEST_JUNIT_OUTPUT_DIR}" STREQUAL "")
    string(REGEX REPLACE "[/\\:\"|<>;]" "-" file_name "${name}")
    rpe_bracket("--out=${TEST_JUNIT_OUTPUT_DIR}/${file_name}.xml" out_text)
    set(junit_text " --reporters=junit ${out_text}")
  endif()

  set(labels_text "")
  if(TEST_ADD_LABELS)
    execute_process(
      COMMAND ${TEST_EXECUTOR} "${TEST_EXECUTABLE}" "--test-case=${filter}" --list-test-suites
      OUTPUT_VARIABLE suites
      RESULT_VARIABLE suites_result
      WORKING_DIRECTORY "${TEST_WORKING_DIR}")
    if(suites_result EQUAL 0)
      string(REPLACE "\n" ";" suites "${suites}")
      foreach(suite IN LISTS suites)
        if(suite STREQUAL "" OR suite MATCHES "^=+$" OR suite MATCHES "^\\[doctest\\] ")
          continue()
        endif()
        rpe_bracket("${suite}" quoted)
        string(APPEND labels_text " ${quoted}")
      endforeach()
    endif()
    if(NOT labels_text STREQUAL "")
      set(labels_text " LABELS${labels_text}")
    endif()
  endif()

  rpe_bracket("${name}" name_text)
  rpe_bracket("--test-case=${filter}" filter_text)
  string(APPEND script
    "add_test(${name_text}${executor_text} ${exe_text} ${filter_text}${junit_text}${extra_args_text})\n"
    "set_tests_properties(${name_text} PROPERTIES WORKING_DIRECTORY ${wd_text}"
    " FAIL_REGULAR_EXPRESSION [==[\\[doctest\\] test cases: +0 \\|]==]${labels_text}${properties_text})\n")
  string(APPEND tests_text " ${name_text}")
endforeach()

if(NOT "${TEST_LIST}" STREQUAL "")
  string(APPEND script "set(${TEST_LIST}${tests_text})\n")
endif()

file(WRITE "${CTEST_FILE}" "${script}")
