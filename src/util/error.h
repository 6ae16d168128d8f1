// One error path for library code: throw talon::Error with a message that names
// the file / tensor / field and what was expected. Only main() turns it into an
// exit code.
#pragma once
#include <fmt/format.h>
#include <stdexcept>
#include <string>

namespace talon {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] inline void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

#define TALON_CHECK(cond, ...)                  \
  do {                                          \
    if (!(cond)) ::talon::fail(__VA_ARGS__);    \
  } while (0)

}  // namespace talon
