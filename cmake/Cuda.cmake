# CUDA is optional: AUTO uses it when nvcc is found, ON requires it, OFF never
# uses it. With it, the daemon's GPU executor (engine/gpu/) is built with our
# kernels and the CUDA runtime linked statically; the driver (libcuda.so.1) is
# only ever dlopen'ed, so every binary starts on machines without a GPU.
set(COLLECTIVED_CUDA AUTO CACHE STRING "Build the GPU executor: AUTO, ON or OFF")
set_property(CACHE COLLECTIVED_CUDA PROPERTY STRINGS AUTO ON OFF)
set(COLLECTIVED_HAVE_CUDA OFF)
if(NOT COLLECTIVED_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Hopper (H100/H200) machine code plus PTX the driver can compile for newer GPUs.
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
    find_package(CUDAToolkit REQUIRED)
    set(COLLECTIVED_HAVE_CUDA ON)
    message(STATUS "collectived: CUDA ${CMAKE_CUDA_COMPILER_VERSION}: building the GPU executor "
                   "(architectures ${CMAKE_CUDA_ARCHITECTURES})")
  elseif(COLLECTIVED_CUDA STREQUAL "ON")
    message(FATAL_ERROR "COLLECTIVED_CUDA=ON but no CUDA compiler (nvcc) was found; set "
                        "CMAKE_CUDA_COMPILER or COLLECTIVED_CUDA=AUTO")
  else()
    message(STATUS "collectived: no nvcc found: building without the GPU executor")
  endif()
endif()
