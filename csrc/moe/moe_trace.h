#pragma once
// Opt-in trace of MoeLayer::forward: where one call's time goes. Off unless armed for the next
// N calls; then each call records its phase timestamps, every GEMM item (who ran it, when, how
// long it waited for its expert's h rows) and when each pool worker joined the GEMM run.
// Off, a call pays one relaxed load (and one branch per item).
// Times: CLOCK_MONOTONIC nanoseconds (steady_clock on Linux), the clock of Python's
// time.monotonic_ns(), so a caller can place its own timestamps beside these.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>

namespace hmoe {

inline int64_t trace_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct TraceItem {
  int32_t worker = -1, down = 0, expert = 0, slice = 0, b0 = 0, b1 = 0;
  int64_t start_ns = 0, end_ns = 0;
  int64_t wait_ns = 0;     // down items: spent waiting for the expert's down activations
  // After end_ns (which stamps the item's own GEMM): for the gate/up item that finished its
  // expert, h -> down activations; for a down item, summing the output columns it completed.
  int64_t convert_ns = 0;
  int32_t deferred = 0;    // the item belongs to a deferred slot's expert (MoeCall::deferred)
};

struct TraceCall {
  int T = 0, K = 0, A = 0;  // tokens, experts per token, distinct experts touched
  int64_t call_ns = 0;      // submit() / run() entered (caller's thread)
  int64_t entry_ns = 0;     // forward() started (driver or caller)
  int64_t grouped_ns = 0;   // tokens grouped by expert, work items built
  int64_t acts_ns = 0;      // x -> gate/up activation rows done
  int64_t items_ns = 0;     // GEMM items built: the pool run starts
  int64_t gemm_end_ns = 0;  // the gate/up + down pool run returned
  int64_t end_ns = 0;       // combine done: forward() returns
  int64_t ready_ns = 0;     // with deferral: out (the own slots) complete and marked ready; else 0
  std::vector<TraceItem> items;  // in item order (each written by the worker that ran it)
  std::vector<int64_t> join_ns;  // per pool worker: entered the GEMM run (0: it never did)
  std::vector<uint8_t> slept;    // per pool worker: it had gone to sleep (futex) before joining
};

class Tracer {
 public:
  void arm(int calls) { left_.store(calls, std::memory_order_relaxed); }
  bool armed() const { return left_.load(std::memory_order_relaxed) > 0; }
  // Claims one traced call (false when not armed or exhausted).
  bool claim() {
    for (int n = left_.load(std::memory_order_relaxed); n > 0;)
      if (left_.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) return true;
    return false;
  }
  void finish(TraceCall&& call) {
    std::lock_guard<std::mutex> lk(mu_);
    done_.push_back(std::move(call));
  }
  std::vector<TraceCall> take() {
    std::vector<TraceCall> out;
    std::lock_guard<std::mutex> lk(mu_);
    out.swap(done_);
    return out;
  }

 private:
  std::atomic<int> left_{0};
  std::mutex mu_;
  std::vector<TraceCall> done_;
};

}  // namespace hmoe
