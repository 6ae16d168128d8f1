// Shared by the libFuzzer targets: the input as a file that readers open by path.
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace talon::fuzz {

// An anonymous memfd holding `data`, reachable as /proc/self/fd/N (no disk, no cleanup).
inline const std::string& as_file(const uint8_t* data, size_t size) {
  static const int fd = [] {
    int f = ::memfd_create("talon_fuzz", MFD_CLOEXEC);
    if (f < 0) std::abort();
    return f;
  }();
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (::ftruncate(fd, 0) != 0) std::abort();
  size_t done = 0;
  while (done < size) {
    ssize_t w = ::pwrite(fd, data + done, size - done, off_t(done));
    if (w <= 0) std::abort();
    done += size_t(w);
  }
  return path;
}

}  // namespace talon::fuzz
