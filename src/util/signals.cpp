#include "util/signals.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>

namespace talon {

namespace {
std::atomic<int> g_signal{0};

void on_signal(int sig) {
  if (g_signal.exchange(sig) != 0) {
    const char msg[] = "\ntalon: second signal, exiting now (finished shards are kept; rerun to resume)\n";
    ssize_t r = ::write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)r;
    ::_exit(128 + sig);
  }
}
}  // namespace

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

bool stop_requested() { return g_signal.load(std::memory_order_relaxed) != 0; }
int stop_signal() { return g_signal.load(); }
void request_stop_for_test() { g_signal.store(SIGTERM); }

}  // namespace talon
