#pragma once

#include <map>
#include <string>

namespace uniep::python {

// What this build contains; the CLI's `uniep info` prints it.
std::map<std::string, std::string> build_info_strings();
bool built_cuda_kernels();
bool built_cuda_ops();

}  // namespace uniep::python
