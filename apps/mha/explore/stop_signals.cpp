// SIGINT and SIGTERM taken by a watcher thread (stop_signals.hpp).
#include "explore/stop_signals.hpp"

#include <pthread.h>
#include <signal.h>

#include <stdexcept>

namespace mha_cli::explore {

namespace {

sigset_t stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

}  // namespace

void block_stop_signals() {
  const sigset_t set = stop_signals();
  if (pthread_sigmask(SIG_BLOCK, &set, nullptr) != 0) throw std::runtime_error("cannot block SIGINT and SIGTERM");
}

StopSignalWatcher::StopSignalWatcher(std::function<void(int)> on_stop) {
  thread_ = std::thread([this, on_stop = std::move(on_stop)] {
    const sigset_t set = stop_signals();
    int signal = 0;
    while (sigwait(&set, &signal) != 0) {
    }
    // The first to set done_ acts: a real signal calls on_stop; the destructor's wake-up does nothing.
    if (!done_.exchange(true)) on_stop(signal);
  });
}

StopSignalWatcher::~StopSignalWatcher() {
  // No signal yet: wake the watcher with a SIGTERM to its thread alone (blocked there, so sigwait takes
  // it), after marking it done so that it returns without calling on_stop.
  if (!done_.exchange(true)) pthread_kill(thread_.native_handle(), SIGTERM);
  thread_.join();
}

}  // namespace mha_cli::explore
