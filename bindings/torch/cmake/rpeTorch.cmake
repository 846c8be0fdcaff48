# rpe_find_torch_python(<found_var>)
#
# Finds a Python interpreter that imports torch (RPE_TORCH_PYTHON if set; else the repository's
# .venv/bin/python that scripts/test.sh makes from bindings/torch/requirements.txt, python3 on
# PATH, then /usr/bin/python3: on Debian the PATH one may be a separate interpreter without torch), sets
# the cache variable RPE_TORCH_PYTHON and prepends torch.utils.cmake_prefix_path to
# CMAKE_PREFIX_PATH (where that folder exists: Debian's libtorch-dev installs TorchConfig.cmake in
# the standard place instead) so that find_package(Torch) works. <found_var> is set to ON when an
# interpreter imports torch and find_package(Torch) succeeds. Also sets RPE_TORCH_CUDA_VERSION
# (internal cache variable) to that torch's `torch.version.cuda` ("" for a CPU-only torch), which
# rpe_torch_cuda_configure() below reads.
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
                    "import os, torch; print(torch.utils.cmake_prefix_path + ';' + os.path.dirname(torch.__file__) + ';' + (torch.version.cuda or ''), end='')"
                    RESULT_VARIABLE _rc OUTPUT_VARIABLE _paths ERROR_QUIET)
    if(_rc EQUAL 0)
      list(GET _paths 0 _prefix)
      list(GET _paths 1 _torch_root)
      list(LENGTH _paths _n)
      set(_torch_cuda "")
      if(_n GREATER 2)
        list(GET _paths 2 _torch_cuda)
      endif()
      set(RPE_TORCH_CUDA_VERSION "${_torch_cuda}" CACHE INTERNAL "torch.version.cuda of RPE_TORCH_PYTHON (empty: CPU-only torch)")
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

# rpe_torch_cuda_configure()
#
# Decides whether rpe_torch's CUDA operators (bindings/torch/src/ops_cuda.cpp and ops_cuda.cu,
# `TORCH_LIBRARY_IMPL(rpe, CUDA, m)`) are built, after rpe_find_torch_python: option
# RPE_TORCH_CUDA defaults to ON when RPE_TORCH_PYTHON's torch is CUDA-enabled
# (RPE_TORCH_CUDA_VERSION, i.e. torch.version.cuda, is set), a CUDA compiler is found (nvcc on
# PATH or in the toolkit's default location /usr/local/cuda/bin) and both have the same CUDA major
# version (e.g. torch 2.15.0+cu132 and nvcc 13.0); otherwise it is a plain OFF (not cached, so a
# later configure looks again) with a configure message saying why. -DRPE_TORCH_CUDA=OFF skips
# them; -DRPE_TORCH_CUDA=ON makes an unmet condition a configure error. When ON, the CUDA
# language is enabled (CMAKE_CUDA_ARCHITECTURES defaults to 90 75, as for RPE_ENABLE_CUDA) and
# CUDAToolkit found (CUDA::cudart, CUDA::cublas). A macro: enable_language must run at the top
# level's file scope (call it from the top-level CMakeLists.txt).
macro(rpe_torch_cuda_configure)
  set(_rpe_tc_doc "Build rpe_torch's CUDA operators (needs a CUDA-enabled torch and nvcc of the same CUDA major version)")
  set(_rpe_tc_why "")
  set(_rpe_tc_nvcc_version "")
  if(DEFINED RPE_TORCH_CUDA AND NOT RPE_TORCH_CUDA)
    set(_rpe_tc_why "RPE_TORCH_CUDA=OFF")
  elseif(NOT RPE_TORCH_CUDA_VERSION)
    set(_rpe_tc_why "${RPE_TORCH_PYTHON}'s torch is CPU-only (torch.version.cuda is None)")
  else()
    if(NOT CMAKE_CUDA_COMPILER)
      _rpe_probe_cuda()
    endif()
    if(NOT CMAKE_CUDA_COMPILER)
      set(_rpe_tc_why "no CUDA compiler found (nvcc; set CMAKE_CUDA_COMPILER)")
    else()
      execute_process(COMMAND "${CMAKE_CUDA_COMPILER}" --version OUTPUT_VARIABLE _rpe_tc_out ERROR_QUIET)
      if(_rpe_tc_out MATCHES "release ([0-9]+)\\.([0-9]+)")
        set(_rpe_tc_nvcc_version "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
      endif()
      string(REGEX MATCH "^[0-9]+" _rpe_tc_torch_major "${RPE_TORCH_CUDA_VERSION}")
      string(REGEX MATCH "^[0-9]+" _rpe_tc_nvcc_major "${_rpe_tc_nvcc_version}")
      if(NOT _rpe_tc_nvcc_major STREQUAL _rpe_tc_torch_major)
        string(CONCAT _rpe_tc_why "torch is built for CUDA ${RPE_TORCH_CUDA_VERSION} but ${CMAKE_CUDA_COMPILER} is CUDA "
                                  "'${_rpe_tc_nvcc_version}' (the major versions must match)")
      endif()
    endif()
  endif()
  if(_rpe_tc_why)
    if(RPE_TORCH_CUDA)
      message(FATAL_ERROR "rpe: RPE_TORCH_CUDA=ON but ${_rpe_tc_why}; configure with -DRPE_TORCH_CUDA=OFF")
    endif()
    set(RPE_TORCH_CUDA OFF)
    message(STATUS "rpe: rpe_torch's CUDA operators are not built: ${_rpe_tc_why}")
  else()
    option(RPE_TORCH_CUDA "${_rpe_tc_doc}" ON)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90 75)  # Hopper, and the oldest architecture nvcc 13 builds
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)  # CUDA::cudart, CUDA::cublas
    message(STATUS "rpe: rpe_torch's CUDA operators: torch CUDA ${RPE_TORCH_CUDA_VERSION}, nvcc ${_rpe_tc_nvcc_version}, "
                   "architectures ${CMAKE_CUDA_ARCHITECTURES}")
  endif()
endmacro()
