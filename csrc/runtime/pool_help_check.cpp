#include "runtime/pool_help_check.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "runtime/thread_pool.h"

namespace hmoe {
namespace {

using Clock = std::chrono::steady_clock;

void spin_for(std::chrono::nanoseconds d) {
  const auto until = Clock::now() + d;
  while (Clock::now() < until) {
  }
}

}  // namespace

std::vector<int> pool_help_check(int threads, int runs, int items, bool wait_for_helper) {
  ThreadPool pool(threads, 1, {{}});
  const int helper = pool.threads();  // the worker index help()'s guest runs items as
  std::vector<std::atomic<int>> count(items);
  std::atomic<int> helped{0}, helped_this_run{0};
  std::atomic<bool> done{false}, gave_up{false};
  auto wait_for_helper_item = [&] {
    const auto deadline = Clock::now() + std::chrono::nanoseconds(kHelperWaitNs);
    while (helped_this_run.load() == 0 && !gave_up.load()) {
      if (Clock::now() > deadline) gave_up.store(true);
      std::this_thread::yield();
    }
  };
  std::thread feeder([&] {
    for (int r = 0; r < runs; ++r)
      pool.wait(pool.submit([&] {
        helped_this_run.store(0);  // the last run has ended: the helper is in none
        pool.run(items, [&](int i, int worker) {
          count[i].fetch_add(1, std::memory_order_relaxed);
          if (worker == helper) {
            helped.fetch_add(1, std::memory_order_relaxed);
            helped_this_run.fetch_add(1);
          } else if (wait_for_helper) {
            wait_for_helper_item();
          }
          spin_for(std::chrono::microseconds(1));
        });
      }));
    done.store(true);
  });
  pool.help([&] { return done.load(); });
  feeder.join();
  std::vector<int> out;
  for (auto& c : count) out.push_back(c.load());
  out.push_back(helped.load());
  return out;
}

}  // namespace hmoe
