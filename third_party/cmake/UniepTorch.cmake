# Locates the installed torch through Python (its include and lib folders) instead of
# find_package(Torch): the Caffe2 config wants a full CUDA toolkit layout on CUDA builds and
# adds flags we do not want on CPU builds. Defines:
#   uniep_torch         INTERFACE target: headers, libc10/libtorch_cpu/libtorch, ABI define
#   uniep_torch_cuda    INTERFACE target: libc10_cuda/libtorch_cuda (only if torch has CUDA)
#   UNIEP_TORCH_HAS_CUDA, UNIEP_TORCH_VERSION
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import os, torch; print(os.path.dirname(torch.__file__)); print(torch.__version__); print(int(torch.version.cuda is not None)); print(int(torch.compiled_with_cxx11_abi()))"
  OUTPUT_VARIABLE _uniep_torch_out
  RESULT_VARIABLE _uniep_torch_rc
  ERROR_VARIABLE _uniep_torch_err
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _uniep_torch_rc EQUAL 0)
  message(FATAL_ERROR
    "UniEP needs torch importable at build time (${_uniep_torch_err}). Install torch first and "
    "build with `pip install --no-build-isolation .` (see README).")
endif()
string(REPLACE "\n" ";" _uniep_torch_out "${_uniep_torch_out}")
list(GET _uniep_torch_out 0 UNIEP_TORCH_DIR)
list(GET _uniep_torch_out 1 UNIEP_TORCH_VERSION)
list(GET _uniep_torch_out 2 _uniep_torch_cuda)
list(GET _uniep_torch_out 3 _uniep_torch_abi)
message(STATUS "UniEP: torch ${UNIEP_TORCH_VERSION} at ${UNIEP_TORCH_DIR} (CUDA: ${_uniep_torch_cuda})")

add_library(uniep_torch INTERFACE)
target_include_directories(uniep_torch SYSTEM INTERFACE
  "${UNIEP_TORCH_DIR}/include" "${UNIEP_TORCH_DIR}/include/torch/csrc/api/include")
target_compile_definitions(uniep_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${_uniep_torch_abi})
target_link_directories(uniep_torch INTERFACE "${UNIEP_TORCH_DIR}/lib")
target_link_libraries(uniep_torch INTERFACE c10 torch_cpu torch)

set(UNIEP_TORCH_HAS_CUDA OFF)
if(_uniep_torch_cuda)
  set(UNIEP_TORCH_HAS_CUDA ON)
  add_library(uniep_torch_cuda INTERFACE)
  target_link_libraries(uniep_torch_cuda INTERFACE c10_cuda torch_cuda)
  if(CMAKE_CUDA_COMPILER)
    find_package(CUDAToolkit REQUIRED)
    target_link_libraries(uniep_torch_cuda INTERFACE CUDA::cudart)
  endif()
endif()
