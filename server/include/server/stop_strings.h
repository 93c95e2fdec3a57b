// server/stop_strings.h: OpenAI's `stop` strings over streamed text.
//
// Generated text arrives in pieces (one per token, or fewer bytes when a
// UTF-8 sequence is split over tokens); a stop string may span several.
// StopMatcher emits only text that can no longer be part of a stop string,
// holds back a tail that may still begin one, and once a stop string is
// complete emits the text before it and nothing more: the stop string itself
// is never emitted.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace rwd::server {

class StopMatcher {
 public:
  // `stops` may be empty (everything passes through). Throws InvalidArgument
  // for an empty stop string (it would match before any text).
  explicit StopMatcher(std::vector<std::string> stops);

  // Appends `text` and returns what may be emitted now. When a stop string
  // completes, returns the text before its earliest occurrence (earliest
  // start; the longest stop string on a tie) and stopped() becomes true;
  // after that every call returns "".
  std::string push(std::string_view text);
  // The end of generation without a stop: the held-back tail, emitted as
  // it is ("" after a stop).
  std::string finish();
  bool stopped() const { return stopped_; }
  // Bytes held back now.
  std::size_t held() const { return held_.size(); }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace rwd::server
