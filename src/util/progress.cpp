#include "util/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

#include "util/log.h"

namespace talon {

std::string format_duration(double s) {
  if (!(s >= 0) || s > 1e8) return "--:--:--";
  const int64_t t = int64_t(s + 0.5);
  return fmt::format("{:02}:{:02}:{:02}", t / 3600, (t / 60) % 60, t % 60);
}

std::string format_count(double v) {
  if (v >= 1e9) return fmt::format("{:.2f}G", v / 1e9);
  if (v >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (v >= 1e4) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

std::string format_rate(double r, const std::string& unit) {
  if (!(r > 0) || !std::isfinite(r)) return fmt::format("-- {}/s", unit);
  if (r < 1) return fmt::format("{:.1f} s/{}", 1 / r, unit);
  if (r < 100) return fmt::format("{:.1f} {}/s", r, unit);
  return fmt::format("{} {}/s", format_count(r), unit);
}

Progress::Progress(std::string label, int64_t total, std::string unit, int64_t already)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), done_(already), start_done_(already),
      t0_(std::chrono::steady_clock::now()), last_(t0_), tty_(isatty(STDERR_FILENO)) {}

Progress::~Progress() {
  if (!finished_ && tty_) std::fputc('\n', stderr);
}

void Progress::advance(int64_t units) {
  std::lock_guard lk(mu_);
  done_ += units;
  auto now = std::chrono::steady_clock::now();
  const double since = std::chrono::duration<double>(now - last_).count();
  if (since >= (tty_ ? 0.2 : 10.0)) {
    last_ = now;
    draw(false);
  }
}

void Progress::set_note(std::string note) {
  std::lock_guard lk(mu_);
  note_ = std::move(note);
}

void Progress::finish() {
  if (finished_) return;
  draw(true);
  finished_ = true;
}

void Progress::draw(bool final) {
  const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  const double rate = el > 0 ? double(done_ - start_done_) / el : 0;
  const double eta = rate > 0 ? double(total_ - done_) / rate : -1;
  const double frac = total_ > 0 ? double(done_) / double(total_) : 1;
  std::string line = fmt::format("{} {:5.1f}% {}/{} {} | {} | elapsed {} | ETA {}", label_, 100 * frac,
                                 format_count(double(done_)), format_count(double(total_)), unit_,
                                 format_rate(rate, unit_), format_duration(el), format_duration(final ? 0 : eta));
  if (!note_.empty()) line += " | " + note_;
  if (tty_) {
    const int width = 24;
    const int fill = int(frac * width);
    std::string bar(1, '[');
    bar.append(size_t(fill), '#').append(size_t(width - fill), '.').append("] ");
    std::fprintf(stderr, "\r%s%s\033[K%s", bar.c_str(), line.c_str(), final ? "\n" : "");
    std::fflush(stderr);
  } else {
    tlog::info("{}", line);
  }
}

}  // namespace talon
