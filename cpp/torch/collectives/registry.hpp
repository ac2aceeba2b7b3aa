// One GPU collectives runtime per process group, created collectively from Python
// (uniep.collectives.init_cuda) and looked up by the CUDA ops through the group's name.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "uniep/cuda/collectives.hpp"

namespace uniep::torch_glue {

void coll_create(const std::string& group_name, const std::vector<uint8_t>& unique_id,
                 const coll::Config& config);
bool coll_exists(const std::string& group_name);
// Collective: every rank of the group must call it.
void coll_destroy(const std::string& group_name);
coll::Runtime& coll_runtime(const std::string& group_name);

}  // namespace uniep::torch_glue
