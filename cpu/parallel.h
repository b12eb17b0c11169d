// parallel_for over a pool of threads the caller does not own (XLA's intra-op pool).
//
// The caller runs items itself and starts up to `threads - 1` helper tasks through
// `schedule`; every task claims items from a shared counter until none are left. The
// caller returns once every item has run, without waiting for helpers that have not
// started: a pool may start a task late, run it inline, or have one thread only (XLA's
// FFI thread pool promises nothing more), and a late helper finds no item and touches
// only the shared counters it co-owns. Which thread runs an item is not fixed, so items
// must not depend on each other.
#ifndef MOE_XLA_CPU_PARALLEL_H_
#define MOE_XLA_CPU_PARALLEL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

namespace moe_xla::cpu {

// Starts `task` on some thread (possibly the calling one, before returning).
using Schedule = std::function<void(std::function<void()> task)>;

// Runs body(item) for every item in [0, count) once. `Worker` is default-constructed once
// per participating thread, on its first item, and called as worker(item): it holds that
// thread's scratch buffers.
template <class Worker>
void parallel_for(int64_t count, int64_t threads, const Schedule& schedule,
                  const std::function<void(Worker&, int64_t)>& body) {
  if (count <= 0) return;
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t count = 0;
    std::mutex mutex;
    std::condition_variable finished;
    const std::function<void(Worker&, int64_t)>* body = nullptr;  // valid while items remain
  };
  auto shared = std::make_shared<Shared>();
  shared->count = count;
  shared->body = &body;
  auto work = [](const std::shared_ptr<Shared>& s) {
    std::unique_ptr<Worker> worker;
    for (int64_t item = s->next.fetch_add(1); item < s->count; item = s->next.fetch_add(1)) {
      if (!worker) worker = std::make_unique<Worker>();
      (*s->body)(*worker, item);
      if (s->done.fetch_add(1) + 1 == s->count) {
        std::lock_guard<std::mutex> lock(s->mutex);
        s->finished.notify_all();
      }
    }
  };
  const int64_t helpers = (threads < count ? threads : count) - 1;
  for (int64_t h = 0; h < helpers && schedule; ++h) {
    schedule([shared, work] { work(shared); });
  }
  work(shared);
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->finished.wait(lock, [&] { return shared->done.load() == count; });
}

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_PARALLEL_H_
