# Finds the CUTLASS/CuTe headers, normally from the `nvidia-cutlass` pip wheel, which keeps them at
# <site-packages>/cutlass_library/source/include. The wheel's Python package is only located, never
# imported: its Python dependencies are not needed for the headers and are usually not installed.
#
# Search order: CUTLASS_DIR (CMake or environment variable; a CUTLASS checkout or a folder holding
# cutlass/version.h), then the wheel in the Python environment that builds us.
#
# Defines:
#   CUTLASS_FOUND, CUTLASS_VERSION ("4.2.0"), CUTLASS_INCLUDE_DIR
#   CUTLASS::headers  INTERFACE target: cutlass/ and cute/ headers

set(_cutlass_hints "")
if(DEFINED CUTLASS_DIR)
  list(APPEND _cutlass_hints "${CUTLASS_DIR}")
elseif(DEFINED ENV{CUTLASS_DIR})
  list(APPEND _cutlass_hints "$ENV{CUTLASS_DIR}")
endif()

if(NOT _cutlass_hints)
  if(NOT Python_EXECUTABLE)
    find_package(Python COMPONENTS Interpreter QUIET)
  endif()
  if(Python_EXECUTABLE)
    # find_spec of a top-level package reads the file system only; importing cutlass_library
    # would fail on its missing dependencies.
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
        "import importlib.util as u; s = u.find_spec('cutlass_library'); print(list(s.submodule_search_locations)[0] if s else '')"
      OUTPUT_VARIABLE _cutlass_py_dir
      OUTPUT_STRIP_TRAILING_WHITESPACE
      ERROR_QUIET)
    if(_cutlass_py_dir)
      list(APPEND _cutlass_hints "${_cutlass_py_dir}/source")
    endif()
  endif()
endif()

find_path(CUTLASS_INCLUDE_DIR NAMES cutlass/version.h cute/tensor.hpp
  HINTS ${_cutlass_hints} PATH_SUFFIXES include source/include NO_DEFAULT_PATH)
if(NOT CUTLASS_INCLUDE_DIR)
  find_path(CUTLASS_INCLUDE_DIR NAMES cutlass/version.h)
endif()

set(CUTLASS_VERSION "")
if(CUTLASS_INCLUDE_DIR AND EXISTS "${CUTLASS_INCLUDE_DIR}/cutlass/version.h")
  file(STRINGS "${CUTLASS_INCLUDE_DIR}/cutlass/version.h" _cutlass_version_lines
    REGEX "#define CUTLASS_(MAJOR|MINOR|PATCH) ")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "CUTLASS_${_part} +([0-9]+)" _m "${_cutlass_version_lines}")
    set(_cutlass_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  if(NOT _cutlass_MAJOR STREQUAL "")
    set(CUTLASS_VERSION "${_cutlass_MAJOR}.${_cutlass_MINOR}.${_cutlass_PATCH}")
  endif()
endif()

if(CUTLASS_INCLUDE_DIR AND NOT EXISTS "${CUTLASS_INCLUDE_DIR}/cute/tensor.hpp")
  message(FATAL_ERROR "CUTLASS at ${CUTLASS_INCLUDE_DIR} has no CuTe (cute/tensor.hpp): UniEP "
    "needs CUTLASS >= 3.0; install `nvidia-cutlass` >= 4.2 or point CUTLASS_DIR at a newer checkout.")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CUTLASS
  REQUIRED_VARS CUTLASS_INCLUDE_DIR CUTLASS_VERSION
  VERSION_VAR CUTLASS_VERSION
  REASON_FAILURE_MESSAGE
    "Install the headers wheel without its Python dependencies, \
`pip install --no-deps nvidia-cutlass==4.2.0.0`, into the Python that builds UniEP, or set \
CUTLASS_DIR to a CUTLASS checkout (the folder holding include/cutlass/version.h).")

if(CUTLASS_FOUND AND NOT TARGET CUTLASS::headers)
  add_library(CUTLASS::headers INTERFACE IMPORTED GLOBAL)
  # SYSTEM: CUTLASS's own warnings are not ours to fix.
  set_target_properties(CUTLASS::headers PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${CUTLASS_INCLUDE_DIR}"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${CUTLASS_INCLUDE_DIR}")
endif()

mark_as_advanced(CUTLASS_INCLUDE_DIR)
