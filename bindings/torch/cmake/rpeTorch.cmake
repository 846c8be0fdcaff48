# rpe_find_torch_python(<found_var>)
#
# Finds a Python interpreter that imports torch (RPE_TORCH_PYTHON if set; else the repository's
# .venv/bin/python that scripts/test.sh makes from bindings/torch/requirements.txt, python3 on
# PATH, then /usr/bin/python3: on Debian the PATH one may be a separate interpreter without torch), sets
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
  elseif(SKBUILD AND Python_EXECUTABLE)
    list(APPEND _candidates "${Python_EXECUTABLE}")  # pip install .: the installing interpreter
  else()
    list(APPEND _candidates "${PROJECT_SOURCE_DIR}/.venv/bin/python")
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
    execute_process(COMMAND "${_py}" -c
                    "import os, torch; print(torch.utils.cmake_prefix_path + ';' + os.path.dirname(torch.__file__), end='')"
                    RESULT_VARIABLE _rc OUTPUT_VARIABLE _paths ERROR_QUIET)
    if(_rc EQUAL 0)
      list(GET _paths 0 _prefix)
      list(GET _paths 1 _torch_root)
      set(RPE_TORCH_PYTHON "${_py}" CACHE FILEPATH "Python interpreter that imports torch (rpe_torch tests)" FORCE)
      # Another torch than the one this tree was configured with: forget the libraries
      # TorchConfig.cmake cached (else a Debian libtorch.so found before stays with a venv's headers).
      if(DEFINED _RPE_TORCH_ROOT AND NOT _RPE_TORCH_ROOT STREQUAL _torch_root)
        foreach(_var IN ITEMS Torch_DIR Caffe2_DIR TORCH_LIBRARY c10_LIBRARY C10_CUDA_LIBRARY kineto_LIBRARY)
          unset(${_var} CACHE)
        endforeach()
      endif()
      set(_RPE_TORCH_ROOT "${_torch_root}" CACHE INTERNAL "torch package folder of RPE_TORCH_PYTHON")
      if(EXISTS "${_prefix}")
        # The package folder first, so that find_library in TorchConfig.cmake picks its lib/ (a
        # system libtorch.so, e.g. Debian's 1.13, must not be found instead).
        list(PREPEND CMAKE_PREFIX_PATH "${_torch_root}" "${_prefix}")
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
