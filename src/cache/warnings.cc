#include "cache/warnings.h"

#include <atomic>
#include <cstdio>
#include <mutex>

#include "rewind/warnings.h"

namespace rwd {
namespace {

std::mutex& handler_mutex() {
  static std::mutex m;
  return m;
}
WarningHandler& handler() {
  static WarningHandler h;
  return h;
}
std::atomic<bool> positive_crop_warned{false};

}  // namespace

WarningHandler set_warning_handler(WarningHandler new_handler) {
  std::lock_guard<std::mutex> lock(handler_mutex());
  WarningHandler previous = std::move(handler());
  handler() = std::move(new_handler);
  return previous;
}

void reset_one_time_warnings() { positive_crop_warned.store(false); }

namespace detail {

void warn_positive_crop_once() {
  if (positive_crop_warned.exchange(true)) return;
  warn(
      "rewind: crop(n) with n > 0 (keep the first n tokens) is deprecated, as in transformers, where its "
      "removal is planned for 5.18; pass a negative n, the number of tokens to remove");
}

void warn(const std::string& message) {
  std::lock_guard<std::mutex> lock(handler_mutex());
  if (handler()) {
    handler()(message);
  } else {
    std::fprintf(stderr, "%s\n", message.c_str());
  }
}

}  // namespace detail
}  // namespace rwd
