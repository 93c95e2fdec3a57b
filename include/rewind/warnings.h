// rewind/warnings.h: where rewind's warnings go.
//
// rewind reports errors by throwing (rewind/error.h); a few conditions that
// are not errors (a deprecated call, a prefix-cache store that fails or is
// slow) warn instead, once per cause, through the handler installed here.
#pragma once

#include <functional>
#include <string>

namespace rwd {

// Receives rewind's warnings: the one-time deprecation warning of a positive
// crop, and a PrefixCache's store failing or being slow (once per cache and
// cause, rewind/prefix_cache.h). The default handler writes the message to
// stderr.
using WarningHandler = std::function<void(const std::string& message)>;
// Installs `handler` (an empty function restores the default) and returns
// the previous one. Thread-safe: installing and emitting take one lock, so a
// handler runs with that lock held. REQUIRES: the handler does not call
// set_warning_handler (it would deadlock).
WarningHandler set_warning_handler(WarningHandler handler);
// Makes one-time warnings fire again (for tests).
void reset_one_time_warnings();

}  // namespace rwd
