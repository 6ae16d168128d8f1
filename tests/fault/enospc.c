/* Test-only LD_PRELOAD shim: a disk that fills up. Writes to files under
 * $TALON_FAULT_DIR succeed until $TALON_FAULT_ENOSPC_AFTER bytes have been written to such
 * files in this process; the write that crosses the limit is cut short, and every later
 * one fails with ENOSPC, as on a full file system. Other files (logs, stderr) are not
 * affected. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static long long g_limit = -1;
static long long g_written = 0;
static const char* g_dir = NULL;
static size_t g_dir_len = 0;
static int g_init = 0;

static void init(void) {
  if (g_init) return;
  const char* l = getenv("TALON_FAULT_ENOSPC_AFTER");
  g_dir = getenv("TALON_FAULT_DIR");
  if (l && g_dir) {
    g_limit = atoll(l);
    g_dir_len = strlen(g_dir);
  }
  g_init = 1;
}

static int watched(int fd) {
  char link[64], target[4096];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof target - 1);
  if (n <= 0) return 0;
  target[n] = 0;
  return strncmp(target, g_dir, g_dir_len) == 0;
}

/* How many of `n` bytes may go to `fd`: n when not watched, else what is left (-1: none). */
static ssize_t allowance(int fd, size_t n) {
  init();
  if (g_limit < 0 || !watched(fd)) return (ssize_t)n;
  long long left = __atomic_load_n(&g_limit, __ATOMIC_RELAXED) - __atomic_load_n(&g_written, __ATOMIC_RELAXED);
  if (left <= 0) return -1;
  return (ssize_t)((long long)n < left ? (long long)n : left);
}

static void account(int fd, ssize_t w) {
  if (w > 0 && g_limit >= 0 && watched(fd)) __atomic_add_fetch(&g_written, w, __ATOMIC_RELAXED);
}

ssize_t write(int fd, const void* buf, size_t n) {
  static ssize_t (*real)(int, const void*, size_t);
  if (!real) real = (ssize_t(*)(int, const void*, size_t))dlsym(RTLD_NEXT, "write");
  ssize_t a = allowance(fd, n);
  if (a < 0) {
    errno = ENOSPC;
    return -1;
  }
  ssize_t w = real(fd, buf, (size_t)a);
  account(fd, w);
  return w;
}

ssize_t pwrite(int fd, const void* buf, size_t n, off_t off) {
  static ssize_t (*real)(int, const void*, size_t, off_t);
  if (!real) real = (ssize_t(*)(int, const void*, size_t, off_t))dlsym(RTLD_NEXT, "pwrite");
  ssize_t a = allowance(fd, n);
  if (a < 0) {
    errno = ENOSPC;
    return -1;
  }
  ssize_t w = real(fd, buf, (size_t)a, off);
  account(fd, w);
  return w;
}

ssize_t writev(int fd, const struct iovec* iov, int cnt) {
  static ssize_t (*real)(int, const struct iovec*, int);
  if (!real) real = (ssize_t(*)(int, const struct iovec*, int))dlsym(RTLD_NEXT, "writev");
  size_t total = 0;
  for (int i = 0; i < cnt; ++i) total += iov[i].iov_len;
  ssize_t a = allowance(fd, total);
  if (a < 0) {
    errno = ENOSPC;
    return -1;
  }
  if ((size_t)a < total) { /* cut short: write only the first `a` bytes */
    size_t left = (size_t)a, done = 0;
    static ssize_t (*rw)(int, const void*, size_t);
    if (!rw) rw = (ssize_t(*)(int, const void*, size_t))dlsym(RTLD_NEXT, "write");
    for (int i = 0; i < cnt && left > 0; ++i) {
      size_t k = iov[i].iov_len < left ? iov[i].iov_len : left;
      ssize_t w = rw(fd, iov[i].iov_base, k);
      if (w <= 0) break;
      done += (size_t)w;
      left -= (size_t)w;
      if ((size_t)w < k) break;
    }
    account(fd, (ssize_t)done);
    return (ssize_t)done;
  }
  ssize_t w = real(fd, iov, cnt);
  account(fd, w);
  return w;
}
