#pragma once
// A check of ThreadPool::help for the tests (hybridmoe._native._pool_help_check).
#include <vector>

namespace hmoe {

// A pool of `threads` threads (unpinned, one group) runs `runs` runs of `items` items (each about
// 1 us of spinning), submitted by another thread, while the calling thread helps (ThreadPool::help)
// until they are done. Returns each item's run count (every one should be `runs`) and, last, the
// items the helper ran.
//
// wait_for_helper: in every run, each pool thread waits inside its items until the helper has
// taken an item of that run. The pool's threads then hold at most `threads` items, so with
// items > threads the run stays open until the helper joins it, and the helper takes at least one
// item of every run whatever the scheduling (a wait gives up after kHelperWaitNs, and every later
// one at once, so that a broken help() fails the count instead of hanging).
std::vector<int> pool_help_check(int threads, int runs, int items, bool wait_for_helper);

constexpr long long kHelperWaitNs = 5'000'000'000;

}  // namespace hmoe
