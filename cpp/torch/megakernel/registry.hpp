// One fused MoE runtime (uniep/cuda/fused_ep.hpp) per process group, created collectively from
// Python (uniep.moe.megakernel.launch.init_fused_ep) and looked up by uniep::moe_fused_ep through
// the group's name.
#pragma once

#include <string>
#include <vector>

#include "uniep/cuda/fused_ep.hpp"

namespace uniep::torch_glue {

void fused_ep_create(const std::string& group_name, const std::vector<uint8_t>& unique_id,
                     const fused::Config& config);
bool fused_ep_exists(const std::string& group_name);
// Collective: every rank of the group must call it.
void fused_ep_destroy(const std::string& group_name);
fused::Runtime& fused_ep_runtime(const std::string& group_name);

}  // namespace uniep::torch_glue
