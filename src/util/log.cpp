#include "util/log.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include "util/error.h"

namespace talon {

namespace {
thread_local std::string g_tag = "main";

class TagFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&, spdlog::memory_buf_t& dest) override {
    dest.append(g_tag.data(), g_tag.data() + g_tag.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<TagFlag>(); }
};
}  // namespace

void set_thread_log_tag(const std::string& tag) { g_tag = tag; }

void init_logging(const std::string& level) {
  auto lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off")
    fail("--log-level '{}': expected one of trace, debug, info, warn, error, off", level);
  auto logger = spdlog::stderr_color_mt("talon");
  auto f = std::make_unique<spdlog::pattern_formatter>();
  f->add_flag<TagFlag>('*').set_pattern("%H:%M:%S.%e %^%L%$ [%*] %v");
  logger->set_formatter(std::move(f));
  logger->set_level(lvl);
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(logger);
}

}  // namespace talon
