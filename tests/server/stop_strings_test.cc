// StopMatcher: stop strings matched across the pieces text arrives in.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "rewind/error.h"
#include "server/stop_strings.h"

namespace {

using rwd::server::StopMatcher;

// Feeds `pieces` and returns what was emitted, with finish() when no stop matched.
std::string run(StopMatcher& m, const std::vector<std::string>& pieces) {
  std::string out;
  for (const std::string& p : pieces) out += m.push(p);
  out += m.finish();
  return out;
}

TEST(StopMatcher, NoStopsPassesEverythingAtOnce) {
  StopMatcher m({});
  EXPECT_EQ(m.push("abc"), "abc");
  EXPECT_EQ(m.held(), 0u);
  EXPECT_EQ(m.finish(), "");
  EXPECT_FALSE(m.stopped());
}

TEST(StopMatcher, MatchesAcrossPiecesAndNeverEmitsTheStop) {
  StopMatcher m({"END"});
  EXPECT_EQ(m.push("the E"), "the ");  // "E" may begin the stop
  EXPECT_EQ(m.held(), 1u);
  EXPECT_EQ(m.push("N"), "");
  EXPECT_EQ(m.push("D and more"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.push("later"), "");
  EXPECT_EQ(m.finish(), "");
}

TEST(StopMatcher, ReleasesAHeldPrefixThatDidNotBecomeTheStop) {
  StopMatcher m({"END"});
  EXPECT_EQ(m.push("EN"), "");
  EXPECT_EQ(m.push("x"), "ENx");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.push("E"), "");
  EXPECT_EQ(m.finish(), "E");  // the end without a stop: the tail goes out
}

TEST(StopMatcher, EarliestStopWinsWhateverItsOrder) {
  StopMatcher m({"world", "lo w"});
  EXPECT_EQ(run(m, {"hel", "lo", " wor", "ld"}), "hel");
  EXPECT_TRUE(m.stopped());
}

TEST(StopMatcher, OneByteAtATimeEqualsWholeText) {
  const std::string text = "In the beginning God created the heaven and the earth.";
  for (const std::string stop : {"God", "the e", "earth.", "zzz", "n"}) {
    StopMatcher whole({stop});
    StopMatcher bytes({stop});
    std::vector<std::string> pieces;
    for (char c : text) pieces.emplace_back(1, c);
    const std::size_t at = text.find(stop);
    const std::string expected = at == std::string::npos ? text : text.substr(0, at);
    EXPECT_EQ(run(whole, {text}), expected) << stop;
    EXPECT_EQ(run(bytes, pieces), expected) << stop;
  }
}

TEST(StopMatcher, RefusesAnEmptyStop) { EXPECT_THROW(StopMatcher({"a", ""}), rwd::InvalidArgument); }

}  // namespace
