// The per-process-group registry both GPU runtimes (expert parallel, collectives) live in: created
// collectively from Python, looked up by the ops through the group's name.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "uniep/status.hpp"

namespace uniep::torch_glue {

inline void ok_or_throw(const Status& s) {
  if (!s.ok()) throw Error(s.code, s.message);
}

// Runtime: has `static Status create(const Config&, const std::vector<uint8_t>&,
// std::unique_ptr<Runtime>*)`. The messages name what the user calls to fix each error.
template <typename Runtime>
class RuntimeRegistry {
 public:
  RuntimeRegistry(const char* what, const char* recreate_hint, const char* missing_hint)
      : what_(what), recreate_hint_(recreate_hint), missing_hint_(missing_hint) {}

  template <typename Config>
  void create(const std::string& group_name, const std::vector<uint8_t>& unique_id,
              const Config& config) {
    std::lock_guard<std::mutex> lock(mutex_);
    UNIEP_CHECK(runtimes_->count(group_name) == 0, "a UniEP ", what_, " for group '", group_name,
                "' exists already; ", recreate_hint_);
    std::unique_ptr<Runtime> rt;
    ok_or_throw(Runtime::create(config, unique_id, &rt));
    (*runtimes_)[group_name] = std::move(rt);
  }

  bool exists(const std::string& group_name) {
    std::lock_guard<std::mutex> lock(mutex_);
    return runtimes_->count(group_name) != 0;
  }

  // Collective: freeing symmetric memory needs every rank of the group.
  void destroy(const std::string& group_name) {
    std::lock_guard<std::mutex> lock(mutex_);
    runtimes_->erase(group_name);
  }

  Runtime& get(const std::string& group_name) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = runtimes_->find(group_name);
    UNIEP_CHECK(it != runtimes_->end(), "group_name '", group_name, "' has no UniEP ", what_, ": ",
                missing_hint_);
    return *it->second;
  }

 private:
  const char* what_;
  const char* recreate_hint_;
  const char* missing_hint_;
  std::mutex mutex_;
  // Never destroyed at exit: freeing symmetric memory is collective, and ranks do not exit in
  // step.
  std::map<std::string, std::unique_ptr<Runtime>>* runtimes_ =
      new std::map<std::string, std::unique_ptr<Runtime>>();
};

}  // namespace uniep::torch_glue
