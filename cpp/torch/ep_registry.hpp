// One GPU expert-parallel runtime per process group, created collectively from Python
// (uniep.init) and looked up by the ops through the group's name.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "uniep/ep.hpp"

namespace uniep::torch_glue {

std::vector<uint8_t> ep_unique_id();
void ep_create(const std::string& group_name, const std::vector<uint8_t>& unique_id,
               const ep::Config& config);
bool ep_exists(const std::string& group_name);
// Collective: every rank of the group must call it.
void ep_destroy(const std::string& group_name);
ep::Runtime& ep_runtime(const std::string& group_name);

}  // namespace uniep::torch_glue
