#include "runtime/thread_pool.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>

#if defined(__x86_64__)
#include <immintrin.h>
#define HMOE_PAUSE() _mm_pause()
#else
#define HMOE_PAUSE() ((void)0)
#endif

namespace hmoe {
namespace {

// How long an idle thread spins before it sleeps, at least: longer than the gap between the
// phases of one forward, far shorter than a scheduler time slice. The workers' window grows
// past it with the gaps between runs (a decode loop calls every layer within tens to hundreds
// of microseconds), up to kMaxSpin; idle past the window, every thread sleeps.
constexpr int64_t kSpinNs = 100'000;
constexpr int64_t kMaxSpinNs = 2'000'000;
// While spinning, give the core away every ~this often so that a thread sharing it (the
// Python thread, a CUDA driver thread) is never starved for long.
constexpr int64_t kYieldNs = 20'000;
// The driver waits for its next job spinning at most this long (the workers' window, if shorter),
// then sleeps: it is pinned to a CPU it may share (the CUDA handoff's flag poller runs there during
// decode), where a longer spin after a prefill's last job would hold up the first decode layers'
// go (sched_yield need not hand the CPU over). Jobs of a submit()-driven decode loop come within
// ~100 us of each other.
constexpr int64_t kDriverSpinNs = 300'000;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Spins until ready() or until window_ns() (re-read as it goes) has passed since the start.
template <class Pred, class Window>
bool spin_until(Pred ready, Window window_ns) {
  const int64_t start = now_ns();
  int64_t next_yield = start + kYieldNs;
  for (int i = 0;; ++i) {
    if (ready()) return true;
    HMOE_PAUSE();
    if ((i & 63) == 63) {
      const int64_t t = now_ns();
      if (t - start > window_ns()) return false;
      if (t > next_yield) {
        sched_yield();
        next_yield = t + kYieldNs;
      }
    }
  }
}
template <class Pred>
bool spin_until(Pred ready) {
  return spin_until(ready, [] { return kSpinNs; });
}

// Sleep while *word == expected (returns at once if it already differs), and wake sleepers.
template <class A>
void futex_wait(A& word, uint32_t expected) {
  static_assert(sizeof(A) == 4, "futexes are 32-bit words");
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
template <class A>
void futex_wake_all(A& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

void pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

std::vector<int> parse_cpulist(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, ',')) {
    if (part.empty() || part == "\n") continue;
    const auto dash = part.find('-');
    const int a = std::stoi(part.substr(0, dash));
    const int b = dash == std::string::npos ? a : std::stoi(part.substr(dash + 1));
    for (int c = a; c <= b; ++c) out.push_back(c);
  }
  return out;
}

}  // namespace

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

std::vector<int> node_cpus(int node) {
  std::ifstream f("/sys/devices/system/node/node" + std::to_string(node) + "/cpulist");
  std::string line;
  if (!f || !std::getline(f, line)) return {};
  const auto allowed = allowed_cpus();
  std::vector<int> out;
  for (int c : parse_cpulist(line))
    for (int a : allowed)
      if (a == c) out.push_back(c);
  return out;
}

int numa_node_count() {
  int n = 0;
  while (std::ifstream("/sys/devices/system/node/node" + std::to_string(n) + "/cpulist")) ++n;
  return n > 0 ? n : 1;
}

ThreadPool::ThreadPool(int threads, int groups, std::vector<std::vector<int>> cpus)
    : groups_(groups), counters_(new Counter[groups]) {
  group_of_.resize(threads + 1);  // the last: help()'s guest, in group 0
  std::vector<int> cpu_of(threads, -1);
  std::vector<int> used(groups, 0);
  for (int w = 0; w < threads; ++w) {
    const int g = int(int64_t(w) * groups / threads);
    group_of_[w] = g;
    if (g < int(cpus.size()) && !cpus[g].empty()) cpu_of[w] = cpus[g][used[g]++ % cpus[g].size()];
  }
  driver_cpu_ = cpu_of[0];
  workers_.reserve(threads - 1);
  try {
    for (int w = 1; w < threads; ++w)
      workers_.emplace_back([this, w, cpu = cpu_of[w]] {
        if (cpu >= 0) pin_to(cpu);
        worker_main(w);
      });
    driver_ = std::thread([this, cpu = cpu_of[0]] {
      if (cpu >= 0) pin_to(cpu);
      driver_main();
    });
  } catch (const std::system_error& e) {
    // The system refused a thread (a process or thread limit): the ones already running stop and
    // are joined here, since no destructor runs for a constructor that throws.
    const size_t started = workers_.size();
    stop_threads();
    throw std::runtime_error("could not start a CPU pool of " + std::to_string(threads) + " threads: the system " +
                             "refused thread " + std::to_string(started + 1) + " (" + e.what() +
                             "); use fewer threads or raise the process limit (ulimit -u)");
  }
}

ThreadPool::~ThreadPool() { stop_threads(); }

void ThreadPool::stop_threads() {
  stop_ = true;
  generation_.fetch_add(1);
  futex_wake_all(generation_);
  {
    std::lock_guard<std::mutex> lk(jobs_mu_);
  }
  jobs_cv_.notify_all();
  for (auto& t : workers_) t.join();
  if (driver_.joinable()) driver_.join();
}

void ThreadPool::work(int worker) {
  const int home = group_of_[worker];
  for (int k = 0; k < groups_; ++k) {
    Counter& c = counters_[(home + k) % groups_];
    for (int i = c.next.fetch_add(1, std::memory_order_relaxed); i < c.end;
         i = c.next.fetch_add(1, std::memory_order_relaxed))
      (*fn_)(i, worker);
  }
}

void ThreadPool::help(FnRef<bool()> done) {
  if (workers_.empty() || guest_.exchange(true)) {
    while (!done()) HMOE_PAUSE();
    return;
  }
  const int me = threads();
  uint32_t joined = generation_.load() - 1;  // so that a run already open is joined too
  for (int i = 0;; ++i) {
    const uint32_t gen = generation_.load();
    if (gen != joined && !stop_) {
      joined = gen;
      join_run(gen, me, false);
      if (done()) break;
      continue;
    }
    if ((i & 15) == 15 && done()) break;
    HMOE_PAUSE();
  }
  guest_.store(false);
}

void ThreadPool::worker_main(int worker) {
  uint32_t seen = 0;
  bool slept = false;  // since the last run this worker joined (for the join log)
  auto window = [this] { return spin_ns_.load(std::memory_order_relaxed); };
  for (;;) {
    auto changed = [&] { return generation_.load() != seen; };
    if (!spin_until(changed, window)) {
      // Dekker with run(): it bumps generation_ then reads sleepers_; we count ourselves in
      // and then read generation_ (all seq_cst), so one of us sees the other.
      sleepers_.fetch_add(1);
      if (!changed()) {
        slept = true;
        futex_wait(generation_, seen);
      }
      sleepers_.fetch_sub(1);
      continue;  // woken by run(), prewake() or spuriously: spin again before sleeping
    }
    seen = generation_.load();
    if (stop_) return;
    if (join_run(seen, worker, slept)) slept = false;
  }
}

bool ThreadPool::join_run(uint32_t gen, int worker, bool slept) {
  // Join run `gen` unless it has closed (or a newer one is being set up): Dekker with run(),
  // which closes then reads active_ (all seq_cst), so it waits for us or we skip.
  active_.fetch_add(1);
  const bool joined = generation_.load() == gen && closed_.load() != gen;
  if (joined) {
    // Inside the run (counted in active_): run() waits for us before it clears the log, which
    // has an entry per pool thread (help()'s guest is not logged).
    if (int64_t* log = join_ns_.load(std::memory_order_relaxed); log && worker < threads()) {
      log[worker] = now_ns();
      join_slept_[worker] = slept;
    }
    work(worker);
  }
  if (active_.fetch_sub(1) == 1 && driver_sleeps_.load()) futex_wake_all(active_);
  return joined;
}

void ThreadPool::run(const std::vector<int>& offsets, ItemFn fn, FnRef<void()> first) {
  const int total = offsets.back() - offsets.front();
  if (total <= 0) return;
  for (int g = 0; g < groups_; ++g) {
    const int gi = g + 1 < int(offsets.size()) ? g : int(offsets.size()) - 2;
    const bool own = g + 1 < int(offsets.size());
    counters_[g].next.store(own ? offsets[gi] : 0, std::memory_order_relaxed);
    counters_[g].end = own ? offsets[gi + 1] : 0;
  }
  fn_ = &fn;
  if (int64_t* log = join_ns_.load(std::memory_order_relaxed)) log[0] = now_ns();
  if (workers_.empty() || total == 1) {
    if (first) first();
    work(0);
    return;
  }
  learn_gap();
  const uint32_t gen = generation_.fetch_add(1) + 1;
  prewake();
  if (first) first();
  work(0);
  // Every item is claimed now: close the run and wait only for the workers inside it (their
  // claimed items), not for those still waking up (a core leaving a deep idle state can take
  // a few hundred microseconds); they will find the run closed and go back to waiting.
  closed_.store(gen);
  auto finished = [&] { return active_.load() == 0; };
  if (!spin_until(finished)) {
    driver_sleeps_.store(true);
    for (int32_t b; (b = active_.load()) != 0;) futex_wait(active_, uint32_t(b));
    driver_sleeps_.store(false);
  }
  last_end_ns_.store(now_ns(), std::memory_order_relaxed);
}

void ThreadPool::learn_gap() {
  // The idle gap since the last run ended. Gaps past kMaxSpin are pauses between requests,
  // not a decode loop: they leave the estimate alone. Within it, the estimate follows a longer
  // gap at once and a shorter one slowly (a forward's own runs come back to back), and the
  // workers spin for twice it.
  const int64_t last = last_end_ns_.load(std::memory_order_relaxed);
  if (last == 0) return;
  const int64_t gap = now_ns() - last;
  if (gap > kMaxSpinNs) return;
  int64_t est = gap_ns_;
  est = gap > est ? gap : est - (est - gap) / 16;
  gap_ns_ = est;
  // In steps of 2^16 ns (~66 us): the spinning workers' line is written only when it moves.
  const int64_t window = (std::clamp<int64_t>(2 * est, kSpinNs, kMaxSpinNs) + 0xFFFF) & ~int64_t(0xFFFF);
  if (window != spin_ns_.load(std::memory_order_relaxed)) spin_ns_.store(window, std::memory_order_relaxed);
}

void ThreadPool::prewake() {
  if (sleepers_.load() > 0) futex_wake_all(generation_);
}

void ThreadPool::run(int items, ItemFn fn) {
  std::vector<int> offsets(groups_ + 1, items);
  offsets[0] = 0;
  run(offsets, fn);
}

uint64_t ThreadPool::submit(std::function<void()> job) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lk(jobs_mu_);
    ticket = next_ticket_++;
    jobs_.emplace_back(ticket, std::move(job));
    submitted_.store(ticket, std::memory_order_release);
  }
  jobs_cv_.notify_one();
  return ticket;
}

void ThreadPool::wait(uint64_t ticket) {
  auto finished = [&] { return finished_ticket_.load(std::memory_order_acquire) >= ticket; };
  if (!spin_until(finished)) {
    std::unique_lock<std::mutex> lk(jobs_mu_);
    jobs_done_cv_.wait(lk, finished);
  }
  std::lock_guard<std::mutex> lk(jobs_mu_);
  if (error_ && error_ticket_ == ticket) {
    auto e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void ThreadPool::driver_main() {
  uint64_t taken = 0;
  for (;;) {
    std::pair<uint64_t, std::function<void()>> job;
    spin_until([&] { return submitted_.load(std::memory_order_acquire) > taken || stop_; },
               [this] { return std::min(spin_ns_.load(std::memory_order_relaxed), kDriverSpinNs); });
    {
      std::unique_lock<std::mutex> lk(jobs_mu_);
      jobs_cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
      if (stop_ && jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.erase(jobs_.begin());
      taken = job.first;
    }
    std::exception_ptr err;
    try {
      std::lock_guard<std::mutex> exec(exec_mu_);
      job.second();
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(jobs_mu_);
      finished_ticket_.store(job.first, std::memory_order_release);
      if (err) {
        error_ = err;
        error_ticket_ = job.first;
      }
    }
    jobs_done_cv_.notify_all();
  }
}

std::shared_ptr<ThreadPool> shared_pool(int threads, int groups) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, std::weak_ptr<ThreadPool>> pools;
  std::lock_guard<std::mutex> lk(mu);
  auto& slot = pools[{threads, groups}];
  if (auto p = slot.lock()) return p;
  // Pin one thread per CPU when there are enough CPUs; group g takes node g's CPUs when the
  // machine has that many NUMA nodes, else an equal share of the allowed CPUs.
  std::vector<std::vector<int>> cpus(groups);
  const auto allowed = allowed_cpus();
  if (threads <= int(allowed.size())) {
    const bool real_nodes = groups > 1 && numa_node_count() == groups;
    for (int g = 0; g < groups; ++g) {
      if (real_nodes) {
        cpus[g] = node_cpus(g);
      } else {
        const size_t a = allowed.size() * g / groups, b = allowed.size() * (g + 1) / groups;
        cpus[g].assign(allowed.begin() + a, allowed.begin() + b);
      }
    }
  }
  auto p = std::make_shared<ThreadPool>(threads, groups, std::move(cpus));
  slot = p;
  return p;
}

}  // namespace hmoe
