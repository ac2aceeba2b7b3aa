// One GPU expert-parallel runtime per process group, created collectively from Python
// (uniep.moe.ep.init_runtime, or by moe_forward / moe_backward through the factory below) and
// looked up by the ops through the group's name.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "uniep/cuda/ep.hpp"

namespace uniep::torch_glue {

std::vector<uint8_t> ep_unique_id();
void ep_create(const std::string& group_name, const std::vector<uint8_t>& unique_id,
               const ep::Config& config);
bool ep_exists(const std::string& group_name);
// Collective: every rank of the group must call it.
void ep_destroy(const std::string& group_name);
ep::Runtime& ep_runtime(const std::string& group_name);

// Creates the group's runtime, or re-creates it larger, collectively (every rank calls it in the
// same op call) for a call of `tokens` tokens on this rank, `hidden`, `top_k` and `num_experts`
// in total. uniep.moe.ep (Python) sets it at import: NVSHMEM is bootstrapped over the torch group
// there. moe_forward / moe_backward call it when the group has no runtime, or when the call
// agreement found it too small on some rank; without it they raise, naming init_runtime.
using EpRuntimeFactory = std::function<void(const std::string& group_name, int64_t tokens,
                                            int64_t hidden, int64_t top_k, int64_t num_experts)>;
void set_ep_runtime_factory(EpRuntimeFactory factory);

}  // namespace uniep::torch_glue
