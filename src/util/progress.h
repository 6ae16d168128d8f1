// Progress reporting for long work: a redrawn bar on a terminal, periodic log lines
// otherwise; both show done/total, tokens/s and ETA.
#pragma once
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace talon {

class Progress {
 public:
  // total_units: e.g. tokens; `unit` names them.
  Progress(std::string label, int64_t total_units, std::string unit, int64_t already_done = 0);
  ~Progress();
  void advance(int64_t units);
  // A short status shown after the counts (e.g. the latest loss); thread-safe.
  void set_note(std::string note);
  void finish();

 private:
  void draw(bool final);
  std::string label_, unit_, note_;
  int64_t total_, done_, start_done_;
  std::chrono::steady_clock::time_point t0_, last_;
  bool tty_, finished_ = false;
  std::mutex mu_;  // advance() may be called from several worker threads
};

std::string format_duration(double seconds);
std::string format_count(double v);  // 12.3k, 4.5M
// A rate of `unit`s per second that stays readable when slow: "12.3k tok/s", "2.5 step/s",
// "4.0 s/step" below one a second, "-- step/s" before there is any.
std::string format_rate(double per_second, const std::string& unit);

}  // namespace talon
