// set_num_threads / num_threads / max_num_threads (include/mha/attention.hpp): the bound, the error
// beyond it, and the scope (the calling thread only). Zero and negative counts are in
// attention/bad_input_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <string>
#include <thread>

#include "mha/attention.hpp"
#include "mha/error.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

// What `action` returns when run on a new std::thread.
template <class F>
auto on_a_new_thread(F action) {
  decltype(action()) result{};
  std::thread worker([&] { result = action(); });
  worker.join();
  return result;
}

TEST(ThreadCount, TheBoundIsAtLeast64AndFourPerCore) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_EQ(mha::max_num_threads(), std::max(64, 4 * cores));
}

TEST(ThreadCount, CountsBeyondTheBoundAreRefusedNamingValueAndBound) {
  ThreadCountGuard guard;
  mha::set_num_threads(2);
  const int bound = mha::max_num_threads();
  // 100000 crashed libgomp at the next parallel region; 1000 aborted under a memory limit.
  for (const int n : {bound + 1, 1000, 100000, INT_MAX}) {
    if (n <= bound) continue;
    try {
      mha::set_num_threads(n);
      ADD_FAILURE() << "set_num_threads(" << n << ") returned";
    } catch (const mha::Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("threads: " + std::to_string(n) + " "), std::string::npos) << message;
      EXPECT_NE(message.find("at most " + std::to_string(bound)), std::string::npos) << message;
    }
    EXPECT_EQ(mha::num_threads(), 2) << "after set_num_threads(" << n << ")";
  }
}

TEST(ThreadCount, TheBoundItselfIsAccepted) {
  ThreadCountGuard guard;
  mha::set_num_threads(mha::max_num_threads());
  EXPECT_EQ(mha::num_threads(), mha::max_num_threads());
}

// OpenMP keeps one count per thread: what one thread sets, another does not see.
TEST(ThreadCount, AppliesToTheCallingThreadOnly) {
  ThreadCountGuard guard;
  const int default_count = on_a_new_thread([] { return mha::num_threads(); });
  mha::set_num_threads(3);
  EXPECT_EQ(mha::num_threads(), 3);
  EXPECT_EQ(on_a_new_thread([] { return mha::num_threads(); }), default_count);
  EXPECT_EQ(on_a_new_thread([] {
              mha::set_num_threads(5);
              return mha::num_threads();
            }),
            5);
  EXPECT_EQ(mha::num_threads(), 3);
}

}  // namespace
}  // namespace mha_test
