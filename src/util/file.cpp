#include "util/file.h"

#include <fcntl.h>
#include <signal.h>
#include <openssl/evp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "util/error.h"

namespace talon {

MappedFile::MappedFile(const fs::path& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open: {}", path.string(), std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    fail("{}: cannot stat: {}", path.string(), std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{}: not a regular file", path.string());
  }
  size_ = size_t(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      fail("{}: mmap failed: {}", path.string(), std::strerror(e));
    }
    data_ = static_cast<uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(data_, size_);
}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (data_) ::munmap(data_, size_);
    path_ = std::move(o.path_);
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

std::string read_text_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open: {}", path.string(), std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail("{}: read error", path.string());
  return ss.str();
}

fs::path path_inside(const fs::path& dir, const std::string& name, const std::string& origin) {
  if (name.empty()) fail("{}: empty file name", origin);
  if (name.find('\0') != std::string::npos) fail("{}: file name contains a NUL byte", origin);
  const fs::path rel(name);
  if (rel.is_absolute() || rel.has_root_name() || rel.has_root_directory())
    fail("{}: '{}' is an absolute path; expected a file name inside {}", origin, name, dir.string());
  for (const auto& part : rel)
    if (part == "..") fail("{}: '{}' leaves its directory ('..'); expected a file name inside {}", origin, name, dir.string());
  const fs::path p = dir / rel;
  std::error_code ec;
  if (fs::symlink_status(p, ec).type() != fs::file_type::not_found && !ec) {
    const fs::path real = fs::canonical(p, ec);
    if (ec) fail("{}: cannot resolve '{}': {}", origin, p.string(), ec.message());
    const fs::path base = fs::canonical(dir.empty() ? fs::path(".") : dir, ec);
    if (ec) fail("{}: cannot resolve the directory {}: {}", origin, dir.string(), ec.message());
    auto b = base.begin();
    auto r = real.begin();
    for (; b != base.end() && r != real.end() && *b == *r; ++b, ++r) {}
    if (b != base.end() || r == real.end())
      fail("{}: '{}' resolves to {} (through a symbolic link), outside {}", origin, name, real.string(), base.string());
  }
  return p;
}

int remove_stale_temps(const fs::path& dir, std::initializer_list<std::string_view> names) {
  int removed = 0;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    for (std::string_view base : names) {
      const std::string prefix = std::string(base) + ".tmp-";
      if (n.size() <= prefix.size() || n.compare(0, prefix.size(), prefix) != 0) continue;
      const std::string pid_s = n.substr(prefix.size());
      if (pid_s.find_first_not_of("0123456789") != std::string::npos || pid_s.size() > 9) continue;
      const long pid = std::stol(pid_s);
      if (pid == long(::getpid()) || ::kill(pid_t(pid), 0) == 0 || errno == EPERM) continue;  // alive
      if (fs::remove(e.path(), ec)) ++removed;
    }
  }
  return removed;
}

AtomicFile::AtomicFile(fs::path path) : path_(std::move(path)) {
  tmp_ = path_;
  tmp_ += ".tmp-" + std::to_string(::getpid());
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("{}: cannot create: {}", tmp_.string(), std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void AtomicFile::write(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      fail("{}: write failed: {}{} (writing the temporary {}; {} was not changed)", path_.string(), std::strerror(e),
           e == ENOSPC || e == EDQUOT ? ": the disk is full, free space and rerun" : "", tmp_.filename().string(),
           path_.filename().string());
    }
    p += w;
    n -= size_t(w);
  }
}

void AtomicFile::commit() {
  if (::fsync(fd_) != 0) {
    const int e = errno;
    fail("{}: fsync failed: {}{} ({} was not changed)", path_.string(), std::strerror(e),
         e == ENOSPC || e == EDQUOT ? ": the disk is full, free space and rerun" : "", path_.filename().string());
  }
  const int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) fail("{}: close failed: {} ({} was not changed)", path_.string(), std::strerror(errno), path_.filename().string());
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    fail("{}: rename to {} failed: {}", tmp_.string(), path_.string(), std::strerror(errno));
  committed_ = true;
  fs::path dir = path_.parent_path();
  if (dir.empty()) dir = ".";
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void write_file_atomic(const fs::path& path, std::string_view content) {
  AtomicFile f(path);
  f.write(content);
  f.commit();
}

Sha256::Sha256() {
  auto* c = EVP_MD_CTX_new();
  EVP_DigestInit_ex(c, EVP_sha256(), nullptr);
  ctx_ = c;
}
Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }
void Sha256::update(const void* data, size_t n) {
  EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data, n);
}
std::string Sha256::hex() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), md, &len);
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (unsigned i = 0; i < len; ++i) {
    s += digits[md[i] >> 4];
    s += digits[md[i] & 15];
  }
  return s;
}

std::string sha256_hex(const void* data, size_t n) {
  Sha256 h;
  h.update(data, n);
  return h.hex();
}

// Streams the file through a fixed buffer, so hashing a large file costs no memory
// (a mapping would leave the whole file resident in this process).
std::string sha256_file_hex(const fs::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open: {}", path.string(), std::strerror(errno));
  Sha256 h;
  std::vector<char> buf(1 << 20);
  for (;;) {
    ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      fail("{}: read error: {}", path.string(), std::strerror(e));
    }
    if (n == 0) break;
    h.update(buf.data(), size_t(n));
  }
  ::close(fd);
  return h.hex();
}

std::string hub_id_hint(const fs::path& path) {
  const std::string p = path.string();
  const std::string ext = path.extension().string();
  const bool file_like = ext == ".gguf" || ext == ".json" || ext == ".jsonl" || ext == ".safetensors" || ext == ".model";
  if (p.empty() || !path.is_relative() || p.front() == '.' || p.back() == '/' || file_like ||
      std::count(p.begin(), p.end(), '/') != 1)
    return "";
  const std::string name = path.filename().string();
  return fmt::format(" (a Hugging Face model id? talon reads local files: download it first, e.g. "
                     "`huggingface-cli download {} --local-dir models/{}`, then pass models/{})",
                     p, name, name);
}

}  // namespace talon
