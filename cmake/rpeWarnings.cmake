# rpe_target_warnings(<target> [NO_WERROR])
#
# Strict warnings for rpe's own test, tool and benchmark targets — never for rpe::rpe itself, so a
# consumer's flags stay the consumer's business. Third-party headers (Eigen, doctest, benchmark,
# nlohmann_json) come in through imported targets as system includes and do not trigger them.
include_guard(GLOBAL)

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
endfunction()
