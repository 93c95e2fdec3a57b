// One-time warnings routed through rwd::set_warning_handler.
#pragma once

#include <string>

namespace rwd::detail {

// Emits the deprecation warning of a positive crop, once per process (or
// once after each reset_one_time_warnings()).
void warn_positive_crop_once();
// Emits `message` through the warning handler (stderr by default).
void warn(const std::string& message);

}  // namespace rwd::detail
