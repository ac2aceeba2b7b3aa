# The C++ package: headers, libuniep_core.a, libuniep_cuda.so (when built) and the CMake config
# that lets a C++ project say find_package(uniep) and link uniep::core or uniep::cuda.
#
# Included by the root CMakeLists after the libraries are defined. UNIEP_INSTALL_* (set there)
# place everything: a GNU layout for a C++ build, the package folder uniep/ for the wheel.
#
# Two export sets, so that a consumer on a machine without CUDA or NVSHMEM still finds uniep::core
# in a package built with CUDA: uniepConfig.cmake loads the CUDA targets only when it finds their
# dependencies (or fails when the consumer asked for COMPONENTS cuda).

include(CMakePackageConfigHelpers)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/uniep
  DESTINATION ${UNIEP_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.hpp"
  # The GPU API (uniep/cuda/) is installed with the library that defines it.
  PATTERN "cuda" EXCLUDE)
install(FILES ${PROJECT_BINARY_DIR}/include/uniep/version.hpp
  DESTINATION ${UNIEP_INSTALL_INCLUDEDIR}/uniep)

install(TARGETS uniep_core EXPORT uniepCoreTargets
  ARCHIVE DESTINATION ${UNIEP_INSTALL_LIBDIR})
install(EXPORT uniepCoreTargets NAMESPACE uniep:: DESTINATION ${UNIEP_INSTALL_CMAKEDIR})

# Where uniepConfig.cmake looks for NVSHMEM (after the consumer's own NVSHMEM_HOME).
set(UNIEP_NVSHMEM_HINTS "")
if(UNIEP_HAVE_CUDA)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/uniep/cuda
    DESTINATION ${UNIEP_INSTALL_INCLUDEDIR}/uniep
    FILES_MATCHING PATTERN "*.hpp")
  install(TARGETS uniep_cuda EXPORT uniepCudaTargets
    LIBRARY DESTINATION ${UNIEP_INSTALL_CUDA_LIBDIR})
  install(EXPORT uniepCudaTargets NAMESPACE uniep:: DESTINATION ${UNIEP_INSTALL_CMAKEDIR})
  # The NVSHMEM wheel has no CMake config, so the package carries our find module. It looks, in
  # the wheel, in the nvidia-nvshmem-cu13 wheel beside it (where the library's RPATH points),
  # then where this build found NVSHMEM (an absolute path: a C++ install is relocatable, but
  # that hint is not; the installed library's RUNPATH holds the same folder).
  install(FILES ${PROJECT_SOURCE_DIR}/third_party/cmake/FindNVSHMEM.cmake
    DESTINATION ${UNIEP_INSTALL_CMAKEDIR})
  if(UNIEP_BUILD_PYTHON)
    list(APPEND UNIEP_NVSHMEM_HINTS "\${PACKAGE_PREFIX_DIR}/../nvidia/nvshmem")
  endif()
  # <home>/lib/libnvshmem_host.so.3 (lib64 in some SDKs) -> <home>
  get_filename_component(_uniep_nvshmem_home "${NVSHMEM_HOST_LIBRARY}" DIRECTORY)
  get_filename_component(_uniep_nvshmem_home "${_uniep_nvshmem_home}" DIRECTORY)
  list(APPEND UNIEP_NVSHMEM_HINTS "${_uniep_nvshmem_home}")
endif()

configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/third_party/cmake/uniepConfig.cmake.in
  ${PROJECT_BINARY_DIR}/uniepConfig.cmake
  INSTALL_DESTINATION ${UNIEP_INSTALL_CMAKEDIR})
# find_package(uniep 0.1) accepts any 0.x from 0.1 on, and no 1.x.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/uniepConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/uniepConfig.cmake ${PROJECT_BINARY_DIR}/uniepConfigVersion.cmake
  DESTINATION ${UNIEP_INSTALL_CMAKEDIR})
