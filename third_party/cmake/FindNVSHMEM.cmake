# Finds NVSHMEM, normally from the pip wheel `nvidia-nvshmem-cu13` (the one CUDA torch pins), which
# ships no CMake config and no unversioned libnvshmem_host.so: hence this module and the IMPORTED
# targets below instead of `-lnvshmem_host`.
#
# Search order: NVSHMEM_HOME (CMake or environment variable; a wheel folder or a full SDK), then the
# `nvidia/nvshmem` folder of the Python environment that builds us.
#
# Defines:
#   NVSHMEM_FOUND, NVSHMEM_VERSION ("3.4.5"), NVSHMEM_INCLUDE_DIR, NVSHMEM_HOST_LIBRARY,
#   NVSHMEM_DEVICE_LIBRARY
# The targets are GLOBAL so that a find_package in one directory serves the whole build.
#   NVSHMEM::host    IMPORTED SHARED: libnvshmem_host.so.3 + headers
#   NVSHMEM::device  IMPORTED STATIC: libnvshmem_device.a. It holds device code *and* the host
#                    half of nvshmem_init (nvshmemi_init_thread), so it must be linked, with CUDA
#                    separable compilation, into the same shared object that calls nvshmem_init:
#                    the device state it initialises is per CUDA module.

set(_nvshmem_hints "")
if(DEFINED NVSHMEM_HOME)
  list(APPEND _nvshmem_hints "${NVSHMEM_HOME}")
elseif(DEFINED ENV{NVSHMEM_HOME})
  list(APPEND _nvshmem_hints "$ENV{NVSHMEM_HOME}")
endif()

if(NOT _nvshmem_hints)
  if(NOT Python_EXECUTABLE)
    find_package(Python COMPONENTS Interpreter QUIET)
  endif()
  if(Python_EXECUTABLE)
    # find_spec only walks the namespace package `nvidia`; nothing heavy is imported.
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
        "import importlib.util as u; s = u.find_spec('nvidia.nvshmem'); print(list(s.submodule_search_locations)[0] if s else '')"
      OUTPUT_VARIABLE _nvshmem_py_dir
      OUTPUT_STRIP_TRAILING_WHITESPACE
      ERROR_QUIET)
    if(_nvshmem_py_dir)
      list(APPEND _nvshmem_hints "${_nvshmem_py_dir}")
    endif()
  endif()
endif()

find_path(NVSHMEM_INCLUDE_DIR NAMES nvshmem.h
  HINTS ${_nvshmem_hints} PATH_SUFFIXES include include/nvshmem)
# The wheel has only the versioned name; an SDK has both.
find_library(NVSHMEM_HOST_LIBRARY NAMES libnvshmem_host.so.3 nvshmem_host
  HINTS ${_nvshmem_hints} PATH_SUFFIXES lib lib64)
find_library(NVSHMEM_DEVICE_LIBRARY NAMES libnvshmem_device.a nvshmem_device
  HINTS ${_nvshmem_hints} PATH_SUFFIXES lib lib64)

# The vendor version lives in non_abi/nvshmem_version.h (nvshmem_constants.h only combines it).
set(NVSHMEM_VERSION "")
if(NVSHMEM_INCLUDE_DIR AND EXISTS "${NVSHMEM_INCLUDE_DIR}/non_abi/nvshmem_version.h")
  file(STRINGS "${NVSHMEM_INCLUDE_DIR}/non_abi/nvshmem_version.h" _nvshmem_version_lines
    REGEX "#define NVSHMEM_VENDOR_(MAJOR|MINOR|PATCH)_VERSION")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "NVSHMEM_VENDOR_${_part}_VERSION +([0-9]+)" _m "${_nvshmem_version_lines}")
    set(_nvshmem_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  if(NOT _nvshmem_MAJOR STREQUAL "")
    set(NVSHMEM_VERSION "${_nvshmem_MAJOR}.${_nvshmem_MINOR}.${_nvshmem_PATCH}")
  endif()
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NVSHMEM
  REQUIRED_VARS NVSHMEM_INCLUDE_DIR NVSHMEM_HOST_LIBRARY NVSHMEM_DEVICE_LIBRARY NVSHMEM_VERSION
  VERSION_VAR NVSHMEM_VERSION
  REASON_FAILURE_MESSAGE
    "Install the wheel CUDA torch pins (`pip install nvidia-nvshmem-cu13==3.4.5`) into the Python \
that builds UniEP, or set NVSHMEM_HOME to a folder holding include/nvshmem.h, \
lib/libnvshmem_host.so.3 and lib/libnvshmem_device.a.")

if(NVSHMEM_FOUND AND NOT TARGET NVSHMEM::host)
  get_filename_component(_nvshmem_soname "${NVSHMEM_HOST_LIBRARY}" NAME)
  add_library(NVSHMEM::host SHARED IMPORTED GLOBAL)
  set_target_properties(NVSHMEM::host PROPERTIES
    IMPORTED_LOCATION "${NVSHMEM_HOST_LIBRARY}"
    IMPORTED_SONAME "${_nvshmem_soname}"
    INTERFACE_INCLUDE_DIRECTORIES "${NVSHMEM_INCLUDE_DIR}")
  # CUDA 13 moved cuda/std/* (which the NVSHMEM headers include) under include/cccl; nvcc adds it
  # by itself, the host compiler does not.
  if(NOT CUDAToolkit_FOUND)
    find_package(CUDAToolkit QUIET)
  endif()
  if(CUDAToolkit_INCLUDE_DIRS)
    foreach(_dir IN LISTS CUDAToolkit_INCLUDE_DIRS)
      if(EXISTS "${_dir}/cccl/cuda/std")
        set_property(TARGET NVSHMEM::host APPEND PROPERTY INTERFACE_INCLUDE_DIRECTORIES
          "$<$<COMPILE_LANGUAGE:CXX>:${_dir}/cccl>")
        break()
      endif()
    endforeach()
  endif()

  add_library(NVSHMEM::device STATIC IMPORTED GLOBAL)
  set_target_properties(NVSHMEM::device PROPERTIES
    IMPORTED_LOCATION "${NVSHMEM_DEVICE_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NVSHMEM_INCLUDE_DIR}"
    # nvshmemi_init_thread in the archive calls into the host library.
    INTERFACE_LINK_LIBRARIES NVSHMEM::host)
endif()

mark_as_advanced(NVSHMEM_INCLUDE_DIR NVSHMEM_HOST_LIBRARY NVSHMEM_DEVICE_LIBRARY)
