// Ctrl-C (SIGINT) and SIGTERM as an orderly stop: the signals are blocked in every thread and taken by
// one watcher thread (sigwait), which calls back; no handler runs inside an interrupted thread.
#pragma once

#include <atomic>
#include <functional>
#include <thread>

namespace mha_cli::explore {

// Blocks SIGINT and SIGTERM in the calling thread and in every thread it starts afterwards (threads
// inherit the mask): call it before starting any thread.
void block_stop_signals();

// Calls on_stop(signal) on its own thread when SIGINT or SIGTERM arrives (once). The destructor
// returns at once if no signal came (and after on_stop returns if one did).
class StopSignalWatcher {
 public:
  explicit StopSignalWatcher(std::function<void(int)> on_stop);
  ~StopSignalWatcher();
  StopSignalWatcher(const StopSignalWatcher&) = delete;
  StopSignalWatcher& operator=(const StopSignalWatcher&) = delete;

 private:
  std::atomic<bool> done_{false};  // a signal was taken, or the destructor woke the watcher
  std::thread thread_;
};

}  // namespace mha_cli::explore
