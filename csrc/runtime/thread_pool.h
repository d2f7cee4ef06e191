#pragma once
// A persistent pool of pinned workers split into groups (one per NUMA node).
//
// run() hands out work items through one atomic counter per group: a worker takes items of its
// own group first, then steals from the other groups; items are claimed one at a time, so a
// slow core never holds up the rest. Idle workers spin (yielding the core every few tens of
// microseconds) for a window that follows the recent gaps between runs: 100 us at least, so a
// forward's phases find them awake, up to 2 ms, so the layers of a decode step (one run every
// tens to hundreds of microseconds) do too. Idle longer, they sleep on futexes (a wake-up
// reaches all of them at once), so a pool of as many threads as cores never busy-waits between
// requests nor starves the thread that feeds it.
//
// Jobs (submit / wait) run in order on the pool's driver thread (between jobs it spins at most
// 300 us, then sleeps), which also acts as worker 0 of group 0 inside run(); run() must only be
// called from a job. run_here() runs a job on the caller's thread (as worker 0), one job at a
// time with the driver's.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace hmoe {

// A reference to a caller's callable, not a copy: what run() calls per item, fn(item, worker),
// and before its own items, first(). A std::function would heap-allocate a lambda that captures
// more than two words (the MoE layer's do), on every call, on the decode path. Empty when
// default-constructed.
template <class Sig>
class FnRef;
template <class R, class... Args>
class FnRef<R(Args...)> {
 public:
  FnRef() = default;
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, FnRef>>>
  FnRef(F&& f)  // NOLINT: binds lambdas implicitly; f must outlive the call it is passed to
      : obj_(const_cast<void*>(static_cast<const void*>(&f))),
        call_([](void* o, Args... args) -> R { return (*static_cast<std::remove_reference_t<F>*>(o))(args...); }) {}
  R operator()(Args... args) const { return call_(obj_, args...); }
  explicit operator bool() const { return call_ != nullptr; }

 private:
  void* obj_ = nullptr;
  R (*call_)(void*, Args...) = nullptr;
};
using ItemFn = FnRef<void(int, int)>;

class ThreadPool {
 public:
  // threads >= 1 (driver included); groups >= 1; cpus[g]: the CPUs group g's threads are
  // pinned to (empty: not pinned). Throws std::runtime_error, naming the thread count, when the
  // system refuses a thread; the threads started before it are stopped and joined first.
  ThreadPool(int threads, int groups, std::vector<std::vector<int>> cpus);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return int(workers_.size()) + 1; }
  // The worker indexes fn(item, worker) may see: the pool's threads and help()'s guest (the last).
  int slots() const { return threads() + 1; }
  int groups() const { return groups_; }
  int group_of(int worker) const { return group_of_[worker]; }
  // The CPU worker 0 (the driver) is pinned to, or -1: where a thread that runs jobs with
  // run_here (instead of the driver) belongs.
  int driver_cpu() const { return driver_cpu_; }

  // Calls fn(item, worker) for every item; group g prefers items [offsets[g], offsets[g+1]).
  // first (if given): what the calling thread does once the workers are on their way, before it
  // takes items or waits (the workers may already run items: fn must wait for what first
  // makes); it must not throw.
  void run(const std::vector<int>& offsets, ItemFn fn, FnRef<void()> first = {});
  // Same with every item in group 0's range (any worker may take them).
  void run(int items, ItemFn fn);
  // The calling thread (not one of the pool's) works as one more worker, index threads() in
  // group 0, in every run from now until done() returns true (asked between runs and items):
  // a thread that would otherwise spin in a wait on a CPU of its own (the decode step's, in
  // CUDA's wait for the step's end) adds its CPU to the layers run meanwhile. One guest at a
  // time; a second caller only waits for its done().
  void help(FnRef<bool()> done);
  // Wakes sleeping workers so that they spin (a run() is coming): their wake-up latency then
  // overlaps the caller's own preparation. Any thread may call it.
  void prewake();
  // Tracing (moe_trace.h): while set, the next run() writes, per worker w that enters its work,
  // join_ns[w] (when; the clock of trace_now_ns) and slept[w] (whether w had gone to sleep
  // since its last run). Arrays of threads() entries, set before run() and cleared after it.
  void set_join_log(int64_t* join_ns, uint8_t* slept) {
    join_slept_ = slept;
    join_ns_.store(join_ns, std::memory_order_relaxed);
  }

  // Queue a job for the driver; returns its ticket. wait(ticket) blocks until it has run and
  // rethrows what it threw.
  uint64_t submit(std::function<void()> job);
  void wait(uint64_t ticket);
  // Runs a job on the calling thread instead of the driver, exclusive with the driver's jobs
  // (a synchronous call skips two thread wake-ups: the driver's and the waiter's).
  template <class Job>
  void run_here(Job&& job) {
    std::lock_guard<std::mutex> exec(exec_mu_);
    job();
  }

 private:
  struct alignas(64) Counter { std::atomic<int> next{0}; int end = 0; };
  void stop_threads();  // stops and joins every thread started (the destructor's work)
  void worker_main(int worker);
  // worker (a pool thread, or help()'s guest) joins run gen if it is still open and works in it;
  // slept goes to the join log. Returns whether it joined.
  bool join_run(uint32_t gen, int worker, bool slept);
  void driver_main();
  void work(int worker);
  void learn_gap();  // called by run() before it starts its workers

  int groups_;
  int driver_cpu_ = -1;
  std::vector<int> group_of_;
  std::vector<std::thread> workers_;
  std::thread driver_;
  std::unique_ptr<Counter[]> counters_;
  const ItemFn* fn_ = nullptr;

  // Workers sleep on generation_ and the driver on active_ with futexes, not a condition
  // variable: every woken thread returns on its own, none queues on a mutex behind the others.
  // sleepers_ / driver_sleeps_ let the wakers skip the syscall while everyone still spins.
  // A run is generation_'s value; closed_ is the last run whose items were all claimed;
  // active_ counts the workers inside work() (or deciding whether to enter it).
  // Each on its own cache line: every worker RMWs active_ as it joins and leaves a run, and a
  // line shared with generation_ / closed_ (which they all read to join) or with fn_ (read per
  // item) would bounce between the cores, once per RMW, while the others wait to read it.
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<uint32_t> closed_{0};
  alignas(64) std::atomic<int32_t> active_{0};
  alignas(64) std::atomic<int32_t> sleepers_{0};
  alignas(64) std::atomic<bool> driver_sleeps_{false};
  // What the workers read as they spin and join (written rarely: by the destructor, by
  // learn_gap when the window changes, by set_join_log), on a line of its own.
  // The idle workers' spin window (ns), learnt by run() from the gaps between runs.
  alignas(64) std::atomic<int64_t> spin_ns_{100'000};
  std::atomic<bool> stop_{false};
  // The join log (set_join_log): published to the workers by run()'s generation_ bump.
  std::atomic<int64_t*> join_ns_{nullptr};
  uint8_t* join_slept_ = nullptr;
  // Only touched by the thread inside run(): when the last run ended; gap_ns_: the gap estimate.
  alignas(64) std::atomic<int64_t> last_end_ns_{0};
  int64_t gap_ns_ = 0;

  std::atomic<bool> guest_{false};  // a thread is inside help()
  std::mutex exec_mu_;  // held while a job runs (driver or run_here)
  std::mutex jobs_mu_;
  std::condition_variable jobs_cv_, jobs_done_cv_;
  std::vector<std::pair<uint64_t, std::function<void()>>> jobs_;
  uint64_t next_ticket_ = 1;
  std::atomic<uint64_t> submitted_{0}, finished_ticket_{0};
  std::exception_ptr error_;
  uint64_t error_ticket_ = 0;
};

// CPUs this process may run on (sched_getaffinity), in order.
std::vector<int> allowed_cpus();
// CPUs of NUMA node `node` that this process may run on; empty if the node does not exist.
std::vector<int> node_cpus(int node);
int numa_node_count();

// One shared pool per (threads, groups): every layer's experts use the same workers. Throws what
// the ThreadPool constructor throws (and caches nothing then).
std::shared_ptr<ThreadPool> shared_pool(int threads, int groups);

}  // namespace hmoe
