# rpe_find_torch_python(<found_var>)
#
# Finds a Python interpreter that imports torch (RPE_TORCH_PYTHON if set; else python3 on PATH,
# then /usr/bin/python3: on Debian the PATH one may be a separate interpreter without torch), sets
# the cache variable RPE_TORCH_PYTHON and prepends torch.utils.cmake_prefix_path to
# CMAKE_PREFIX_PATH (where that folder exists: Debian's libtorch-dev installs TorchConfig.cmake in
# the standard place instead) so that find_package(Torch) works. <found_var> is set to ON when an
# interpreter imports torch and find_package(Torch) succeeds.
include_guard(GLOBAL)

function(rpe_find_torch_python found_var)
  set(${found_var} OFF PARENT_SCOPE)
  set(_candidates)
  if(RPE_TORCH_PYTHON)
    list(APPEND _candidates "${RPE_TORCH_PYTHON}")
  else()
    find_program(_rpe_path_python3 NAMES python3)
    if(_rpe_path_python3)
      list(APPEND _candidates "${_rpe_path_python3}")
    endif()
    list(APPEND _candidates /usr/bin/python3)
  endif()
  foreach(_py IN LISTS _candidates)
    if(NOT EXISTS "${_py}")
      continue()
    endif()
    execute_process(COMMAND "${_py}" -c "import torch; print(torch.utils.cmake_prefix_path, end='')"
                    RESULT_VARIABLE _rc OUTPUT_VARIABLE _prefix ERROR_QUIET)
    if(_rc EQUAL 0)
      set(RPE_TORCH_PYTHON "${_py}" CACHE FILEPATH "Python interpreter that imports torch (rpe_torch tests)" FORCE)
      if(EXISTS "${_prefix}")
        list(PREPEND CMAKE_PREFIX_PATH "${_prefix}")
        set(CMAKE_PREFIX_PATH "${CMAKE_PREFIX_PATH}" PARENT_SCOPE)
      endif()
      find_package(Torch QUIET CONFIG)
      if(Torch_FOUND)
        set(${found_var} ON PARENT_SCOPE)
        message(STATUS "rpe: torch imported by ${_py}; Torch ${Torch_VERSION} at ${Torch_DIR}")
      else()
        message(STATUS "rpe: ${_py} imports torch but find_package(Torch) fails (Debian: install libtorch-dev); "
                       "RPE_BUILD_TORCH defaults to OFF")
      endif()
      return()
    endif()
  endforeach()
  message(STATUS "rpe: no Python interpreter imports torch; RPE_BUILD_TORCH defaults to OFF")
endfunction()
