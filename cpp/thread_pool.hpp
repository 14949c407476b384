// The kernel's threads: run `work(item)` for items 0 .. count-1 on up to `threads` threads,
// the calling one included, each taking the next item as it finishes one.
//
// Why the threads are here and not in Python (boost-histogram's split would have Python own
// them): the items exist only after the whole table is validated and each copy's axes are
// simplified, as slices of one copy's outermost axis or batches of small copies, several per
// thread so that uneven ones balance; they point into that C++ state. Owning threads in
// Python would mean exporting the items and crossing the binding once per item from each
// thread, for nothing: the GIL is released once for the whole call already (bindings.cpp),
// and no Python runs until every item is done. So the pool stays, isolated here: a dozen
// lines that know nothing of copies.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

namespace aoa {

template <typename Work>
void run_in_parallel(size_t count, int64_t threads, const Work& work) {
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t item = next++; item < count; item = next++) work(item);
  };
  std::vector<std::thread> helpers;
  try {
    for (int64_t t = 1; t < std::min<int64_t>(threads, static_cast<int64_t>(count)); ++t)
      helpers.emplace_back(worker);
  } catch (const std::system_error&) {
    // The system gives no more threads: the ones running share the work.
  }
  worker();
  for (std::thread& helper : helpers) helper.join();
}

}  // namespace aoa
