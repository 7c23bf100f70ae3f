// Per-node counters of the custom ops, process-wide: launches of compiled kernels and calls that ran ONNX
// Runtime's kernel instead, with the last reason, keyed by node name. Counting is lock-free (atomics), and so
// is a fallback whose reason is the one recorded last (the common case: a node falls back for one reason
// call after call); the reason lock is taken when the reason changes, the registry lock once per kernel
// construction (dc_node_counter) and by readers.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "core.h"

// A counter's reason is `reason` (under reason_mutex); `last` points to an immutable copy of it in `interned`
// (null after a reset, or once a counter has seen more distinct reasons than it interns), so that a fallback
// for the reason recorded last compares it without the lock. Interned copies are never freed: a reader may
// hold one.
struct dc_node_counter {
  std::string node;
  std::atomic<int64_t> launches{0}, fallbacks{0};
  std::atomic<const std::string*> last{nullptr};
  std::mutex reason_mutex;
  std::string reason;
  std::set<std::string, std::less<>> interned;
};

namespace dietcode {
namespace {

constexpr size_t kInternedReasons = 64;  // distinct reasons a counter compares without the lock

struct CounterRegistry {
  std::mutex mutex;
  std::deque<dc_node_counter> counters;  // a deque keeps addresses stable as it grows
  std::map<std::string, dc_node_counter*> by_node;
};

CounterRegistry& Counters() {
  static CounterRegistry* registry = new CounterRegistry;  // never destroyed: kernels may outlive statics
  return *registry;
}

}  // namespace
}  // namespace dietcode

extern "C" {

dc_node_counter* dc_node_counter_get(const char* node) {
  dietcode::CounterRegistry& r = dietcode::Counters();
  const std::string name = node != nullptr ? node : "";
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.by_node.find(name);
  if (it != r.by_node.end()) return it->second;
  r.counters.emplace_back();
  dc_node_counter* c = &r.counters.back();
  c->node = name;
  r.by_node.emplace(name, c);
  return c;
}

void dc_node_count_launch(dc_node_counter* counter) {
  if (counter != nullptr) counter->launches.fetch_add(1, std::memory_order_relaxed);
}

void dc_node_count_fallback(dc_node_counter* counter, const char* reason) {
  if (counter == nullptr) return;
  counter->fallbacks.fetch_add(1, std::memory_order_relaxed);
  if (reason == nullptr) return;
  const std::string* last = counter->last.load(std::memory_order_acquire);
  if (last != nullptr && std::strcmp(last->c_str(), reason) == 0) return;  // already the recorded reason
  std::lock_guard<std::mutex> lock(counter->reason_mutex);
  if (counter->reason != reason) counter->reason = reason;
  auto it = counter->interned.find(counter->reason);
  if (it == counter->interned.end() && counter->interned.size() < dietcode::kInternedReasons) {
    it = counter->interned.insert(counter->reason).first;
  }
  counter->last.store(it != counter->interned.end() ? &*it : nullptr, std::memory_order_release);
}

int64_t dc_node_stats_count(void) {
  dietcode::CounterRegistry& r = dietcode::Counters();
  std::lock_guard<std::mutex> lock(r.mutex);
  return static_cast<int64_t>(r.counters.size());
}

int dc_node_stats_get(int64_t index, char* node, size_t node_size, int64_t* launches, int64_t* fallbacks,
                      char* reason, size_t reason_size) {
  dietcode::CounterRegistry& r = dietcode::Counters();
  dc_node_counter* c = nullptr;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (index < 0 || index >= static_cast<int64_t>(r.counters.size())) return -1;
    c = &r.counters[static_cast<size_t>(index)];
  }
  if (node != nullptr && node_size > 0) std::snprintf(node, node_size, "%s", c->node.c_str());
  if (launches) *launches = c->launches.load(std::memory_order_relaxed);
  if (fallbacks) *fallbacks = c->fallbacks.load(std::memory_order_relaxed);
  if (reason != nullptr && reason_size > 0) {
    std::lock_guard<std::mutex> lock(c->reason_mutex);
    std::snprintf(reason, reason_size, "%s", c->reason.c_str());
  }
  return static_cast<int>(c->node.size());
}

void dc_node_stats_reset(void) {
  dietcode::CounterRegistry& r = dietcode::Counters();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (dc_node_counter& c : r.counters) {
    c.launches.store(0, std::memory_order_relaxed);
    c.fallbacks.store(0, std::memory_order_relaxed);
    std::lock_guard<std::mutex> reason_lock(c.reason_mutex);
    c.reason.clear();
    c.last.store(nullptr, std::memory_order_release);
  }
}

}  // extern "C"
