// Prefix reuse in the runtime (GenerationOptions::prefix_cache): generation
// with a prefix cache, cold or warm, full or partial hits, greedy, sampled
// and speculative, gives exactly the tokens of generation without one; the
// CLI's --prefix-cache over a directory and over Redis (two processes, four
// writing at once, Redis stopped), damaged entries, and snapshot files.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "generation_options.h"
#include "rewind/prefix_cache.h"
#include "rewind/store.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/weights_io.h"
#include "store/redis_server.h"
#include "store/store_test_util.h"
#include "test_configs.h"

namespace rwd::runtime {
namespace {

using testing_configs::hybrid;
using testing_configs::kEveryKind;

std::vector<std::int32_t> prompt_of(std::int64_t n, std::int32_t salt) {
  std::vector<std::int32_t> t{256};  // BOS
  for (std::int64_t i = 1; i < n; ++i) t.push_back(static_cast<std::int32_t>((i * 37 + salt * 11 + i * i) % 256));
  return t;
}

std::unique_ptr<PrefixCache> memory_prefix_cache(const Model& m, std::int64_t interval) {
  PrefixCacheOptions o;
  o.interval = interval;
  o.model_fingerprint = m.fingerprint();
  return std::make_unique<PrefixCache>(std::shared_ptr<BlobStore>(make_memory_store(0)), o);
}

TEST(PrefixGeneration, ColdWarmAndPartialHitsGiveTheSameTokens) {
  const Model model(ModelWeights::random(hybrid(kEveryKind), 41));
  auto pc = memory_prefix_cache(model, 16);
  GenerationOptions plain;
  plain.max_new_tokens = 12;
  plain.stop_at_eos = false;
  GenerationOptions cached = plain;
  cached.prefix_cache = pc.get();
  const auto p = prompt_of(150, 1);
  const auto want = generate(model, p, plain);
  GenerationStats s1, s2;
  EXPECT_EQ(generate(model, p, cached, &s1), want);
  EXPECT_EQ(s1.prefix_hit_tokens, 0);
  EXPECT_EQ(s1.forwards, 10 + 11);  // 9 boundaries of 16 and the end, then 11 decode steps
  EXPECT_EQ(generate(model, p, cached, &s2), want);
  EXPECT_EQ(s2.prefix_hit_tokens, 150);
  EXPECT_EQ(s2.forwards, 11);  // no prefill forward: the entry holds the last logits
  // A prompt sharing the first 100 tokens: hit at 96, the rest computed.
  auto q = p;
  q[100] ^= 1;
  GenerationStats s3;
  EXPECT_EQ(generate(model, q, cached, &s3), generate(model, q, plain));
  EXPECT_EQ(s3.prefix_hit_tokens, 96);
  // Sampling: the same draws with and without the cache.
  GenerationOptions sp = plain, sc = cached;
  sp.sampling.temperature = sc.sampling.temperature = 0.9f;
  sp.sampling.seed = sc.sampling.seed = 7;
  EXPECT_EQ(generate(model, p, sc), generate(model, p, sp));
  // An entry of another model under this fingerprint would not restore: a
  // cache of another model's fingerprint simply never hits.
  const Model other(ModelWeights::random(hybrid(kEveryKind), 42));
  EXPECT_NE(other.fingerprint(), model.fingerprint());
  EXPECT_EQ(Model(ModelWeights::random(hybrid(kEveryKind), 41)).fingerprint(), model.fingerprint());
}

TEST(PrefixGeneration, SpeculativeDecodingWithAPrefixCacheEqualsGreedy) {
  const Model model(ModelWeights::random(hybrid(kEveryKind), 43));
  auto pc = memory_prefix_cache(model, 8);
  GenerationOptions plain;
  plain.max_new_tokens = 20;
  plain.stop_at_eos = false;
  GenerationOptions cached = plain;
  cached.prefix_cache = pc.get();
  const auto p = prompt_of(61, 2);
  const auto want = generate(model, p, plain);
  for (int run = 0; run < 2; ++run) {
    LookupDraft lookup(3);
    GenerationStats s;
    EXPECT_EQ(speculative_generate(model, lookup, p, with_chain(cached, {4, false}), &s), want) << "run " << run;
    EXPECT_EQ(s.prefix_hit_tokens, run == 0 ? 0 : 60);  // the target prefills all but the pending token
    ModelDraft self(model, {}, 3);
    EXPECT_EQ(speculative_generate(model, self, p, with_chain(cached, {3, false})), want) << "run " << run;
  }
  // Plain generation of the same prompt finds the speculative run's entry at P - 1.
  GenerationStats s;
  EXPECT_EQ(generate(model, p, cached, &s), want);
  EXPECT_EQ(s.prefix_hit_tokens, 60);
}

TEST(PrefixGeneration, BatchedDecodingReusesPrefixesPerSequence) {
  const Model model(ModelWeights::random(hybrid(kEveryKind), 45));
  auto pc = memory_prefix_cache(model, 16);
  GenerationOptions plain;
  plain.max_new_tokens = 9;
  plain.stop_at_eos = false;
  plain.max_batch = 2;  // the third joins later
  GenerationOptions cached = plain;
  cached.prefix_cache = pc.get();
  const std::vector<std::vector<std::int32_t>> prompts = {prompt_of(70, 4), prompt_of(33, 5), prompt_of(1, 6)};
  const auto want = generate_batch(model, prompts, plain);
  for (int run = 0; run < 2; ++run) {
    GenerationStats s;
    EXPECT_EQ(generate_batch(model, prompts, cached, &s), want) << "run " << run;
    EXPECT_EQ(s.per_sequence[0].prefix_hit_tokens, run == 0 ? 0 : 69);
    EXPECT_EQ(s.per_sequence[1].prefix_hit_tokens, run == 0 ? 0 : 32);
    EXPECT_EQ(s.per_sequence[2].prefix_hit_tokens, 0);  // BOS alone: nothing to prefill
    PerSequenceDrafts drafts([] {
      std::vector<std::unique_ptr<DraftSource>> v;
      for (int i = 0; i < 3; ++i) v.push_back(std::make_unique<LookupDraft>(2));
      return v;
    }());
    GenerationStats ss;
    EXPECT_EQ(speculative_generate_batch(model, drafts, prompts, with_chain(cached, {3, false}), &ss), want)
        << "run " << run;
    EXPECT_EQ(ss.per_sequence[0].prefix_hit_tokens, 69);  // the batched greedy run stored [0, 69)
  }
  // A solo run of prompt 0 finds the batched run's entry at P - 1.
  GenerationStats solo;
  EXPECT_EQ(generate(model, prompts[0], cached, &solo), want[0]);
  EXPECT_EQ(solo.prefix_hit_tokens, 69);
}

TEST(PrefixGeneration, ContinueGenerationFromARestoredSnapshot) {
  const Model model(ModelWeights::random(hybrid(kEveryKind), 44));
  GenerationOptions o;
  o.max_new_tokens = 10;
  o.stop_at_eos = false;
  const auto p = prompt_of(40, 3);
  const auto want = generate(model, p, o);
  Cache cache = model.make_cache();
  std::vector<float> logits;
  GenerationStats s;
  prefill(model, p, cache, logits, nullptr, s);
  const Snapshot snap = cache.snapshot();
  const std::vector<std::byte> bytes = serialize_snapshot(snap, model.fingerprint());
  Cache restored = model.make_cache();
  restored.restore(deserialize_snapshot(bytes));
  EXPECT_EQ(continue_generation(model, restored, logits, o), want);
  std::vector<float> wrong(3);
  EXPECT_THROW(continue_generation(model, restored, wrong, o), InvalidArgument);
  Cache empty = model.make_cache();
  EXPECT_THROW(continue_generation(model, empty, logits, o), InvalidArgument);
}

#ifdef REWIND_CLI_PATH
using namespace cli_test;

class PrefixCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = (scratch_dir() / "prefix_models").string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    write_random_model(hybrid(kEveryKind), dir_ + "/target", 5, DType::BF16);
    write_random_model(hybrid({"conv", "sliding_attention"}, 16, 4), dir_ + "/other", 6, DType::F32);
    std::string prompt;
    for (int i = 0; i < 700; ++i) prompt += static_cast<char>('a' + (i * 7 + i / 13) % 26);
    write_file(dir_ + "/prompt.txt", prompt);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static std::string args(const std::string& cache, const std::string& extra = "") {
    return "generate --model " + quote(dir_ + "/target") + " --prompt-file " + quote(dir_ + "/prompt.txt") +
           " --max-new-tokens 16 --stats --prefix-interval 64 --prefix-cache " + quote(cache) + " " + extra;
  }
  static nlohmann::json stats_of(const CliResult& r) {
    const std::size_t end = r.out.size() - 1;
    const std::size_t start = r.out.rfind('\n', end - 1) + 1;
    return nlohmann::json::parse(r.out.substr(start, end - start));
  }
  static std::string text_of(const CliResult& r) { return r.out.substr(0, r.out.rfind('\n', r.out.size() - 2)); }
  static std::string plain_text() {
    const CliResult r = run_cli("generate --model " + quote(dir_ + "/target") + " --prompt-file " +
                                quote(dir_ + "/prompt.txt") + " --max-new-tokens 16 --stats");
    EXPECT_EQ(r.status, 0) << r.all();
    return text_of(r);
  }
  static std::string dir_;
};
std::string PrefixCli::dir_;

TEST_F(PrefixCli, DirectoryCacheHitsAndDamagedEntriesAreRecomputed) {
  const std::string want = plain_text();
  const std::string cache = dir_ + "/cache";
  const CliResult cold = run_cli(args(cache));
  ASSERT_EQ(cold.status, 0) << cold.all();
  EXPECT_EQ(text_of(cold), want);
  EXPECT_EQ(stats_of(cold)["prefix_hit_tokens"], 0);
  const CliResult warm = run_cli(args(cache));
  ASSERT_EQ(warm.status, 0) << warm.all();
  EXPECT_EQ(text_of(warm), want);
  EXPECT_EQ(stats_of(warm)["prefix_hit_tokens"], 701);  // BOS + 700 bytes
  // Flip one byte in every entry: all are rejected, the output is unchanged.
  int files = 0;
  for (const auto& e : fs::directory_iterator(cache)) {
    std::string bytes = read_file(e.path());
    bytes[bytes.size() / 3] ^= 0x01;
    write_file(e.path(), bytes);
    ++files;
  }
  EXPECT_EQ(files, 11);  // 64, 128, ..., 640 and 701
  const CliResult damaged = run_cli(args(cache));
  ASSERT_EQ(damaged.status, 0) << damaged.all();
  EXPECT_EQ(text_of(damaged), want);
  EXPECT_EQ(stats_of(damaged)["prefix_hit_tokens"], 0);
  // The damaged run rewrote the entries: the next one hits again.
  EXPECT_EQ(stats_of(run_cli(args(cache)))["prefix_hit_tokens"], 701);
  // Truncated entries: the same.
  for (const auto& e : fs::directory_iterator(cache)) {
    std::string bytes = read_file(e.path());
    write_file(e.path(), bytes.substr(0, bytes.size() / 2));
  }
  const CliResult truncated = run_cli(args(cache));
  EXPECT_EQ(text_of(truncated), want);
  EXPECT_EQ(stats_of(truncated)["prefix_hit_tokens"], 0);
  // Another model's run over the same directory never hits this model's entries.
  const CliResult other = run_cli("generate --model " + quote(dir_ + "/other") + " --prompt-file " +
                                  quote(dir_ + "/prompt.txt") + " --max-new-tokens 4 --stats --prefix-cache " +
                                  quote(cache));
  ASSERT_EQ(other.status, 0) << other.all();
  EXPECT_EQ(stats_of(other)["prefix_hit_tokens"], 0);
}

TEST_F(PrefixCli, RedisSharedByProcessesAndStoppedMidway) {
  rwd::test::RedisServer server;
  const std::string want = plain_text();
  // Four processes prefill the same prompt at once, writing the same entries.
  const std::string out = (scratch_dir() / "concurrent").string();
  std::string cmd;
  for (int i = 0; i < 4; ++i)
    cmd += quote(REWIND_CLI_PATH) + " " + args(server.url()) + " > " + quote(out + std::to_string(i)) + " 2>&1 & ";
  cmd += "wait";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  for (int i = 0; i < 4; ++i) {
    const std::string text = read_file(out + std::to_string(i));
    EXPECT_EQ(text.substr(0, want.size()), want) << "process " << i << ": " << text;
  }
  // A fifth process reads whole entries only: a full hit, the same output.
  const CliResult warm = run_cli(args(server.url()));
  ASSERT_EQ(warm.status, 0) << warm.all();
  EXPECT_EQ(text_of(warm), want);
  EXPECT_EQ(stats_of(warm)["prefix_hit_tokens"], 701);
  // Redis stopped: one warning, recomputation, the same output.
  server.stop();
  const CliResult down = run_cli(args(server.url()));
  ASSERT_EQ(down.status, 0) << down.all();
  EXPECT_EQ(text_of(down), want);
  EXPECT_EQ(stats_of(down)["prefix_hit_tokens"], 0);
  EXPECT_NE(down.err.find("warning"), std::string::npos) << down.err;
  // A full Redis (maxmemory, no eviction) refuses writes: still the same output.
  rwd::test::RedisServer full({"--maxmemory", "1mb", "--maxmemory-policy", "noeviction"});
  const CliResult refused = run_cli(args(full.url()));
  ASSERT_EQ(refused.status, 0) << refused.all();
  EXPECT_EQ(text_of(refused), want);
}

TEST_F(PrefixCli, BadPrefixOptionsAreUsageErrors) {
  const std::string base = "generate --model " + quote(dir_ + "/target") + " --prompt x ";
  EXPECT_EQ(run_cli(base + "--prefix-interval 8").status, 2);
  EXPECT_EQ(run_cli(base + "--prefix-cache " + quote(dir_ + "/c") + " --prefix-interval 0").status, 2);
  const CliResult url = run_cli(base + "--prefix-cache redis://127.0.0.1:notaport");
  EXPECT_EQ(url.status, 2);
  EXPECT_NE(url.err.find("redis://"), std::string::npos) << url.err;
}

TEST_F(PrefixCli, BatchedPromptsReusePrefixes) {
  write_file(dir_ + "/prompts.txt", read_file(dir_ + "/prompt.txt").substr(0, 300) + "\nshort\n" +
                                        read_file(dir_ + "/prompt.txt").substr(0, 200) + "x\n");
  const std::string base = "generate --model " + quote(dir_ + "/target") + " --prompts " +
                           quote(dir_ + "/prompts.txt") + " --max-new-tokens 8 --stats";
  const CliResult plain = run_cli(base);
  ASSERT_EQ(plain.status, 0) << plain.all();
  const std::string lines = plain.out.substr(0, plain.out.rfind('\n', plain.out.size() - 2));
  const std::string cached = base + " --prefix-interval 32 --prefix-cache " + quote(dir_ + "/batch_cache");
  for (int run = 0; run < 2; ++run) {
    const CliResult r = run_cli(cached);
    ASSERT_EQ(r.status, 0) << r.all();
    EXPECT_EQ(r.out.substr(0, r.out.rfind('\n', r.out.size() - 2)), lines) << "run " << run;
    const nlohmann::json st = stats_of(r);
    // Run 0: the third prompt shares 201 tokens with the first (BOS + 200
    // bytes), whose entries at 32..192 it may find; run 1: every prompt
    // but its last token.
    if (run == 1) {
      EXPECT_EQ(st["per_sequence"][0]["prefix_hit_tokens"], 300);
      EXPECT_EQ(st["per_sequence"][1]["prefix_hit_tokens"], 5);
      EXPECT_EQ(st["per_sequence"][2]["prefix_hit_tokens"], 201);
    }
  }
}

TEST_F(PrefixCli, SnapshotFilesSaveInspectAndLoad) {
  const std::string file = dir_ + "/state.rwsnap";
  const CliResult save = run_cli("snapshot save --model " + quote(dir_ + "/target") + " --prompt-file " +
                                 quote(dir_ + "/prompt.txt") + " --out " + quote(file));
  ASSERT_EQ(save.status, 0) << save.all();
  const CliResult inspect = run_cli("snapshot inspect --file " + quote(file));
  ASSERT_EQ(inspect.status, 0) << inspect.all();
  EXPECT_NE(inspect.out.find("length: 701 tokens"), std::string::npos) << inspect.out;
  EXPECT_NE(inspect.out.find("every checksum verified"), std::string::npos) << inspect.out;
  const CliResult load = run_cli("snapshot load --model " + quote(dir_ + "/target") + " --file " + quote(file) +
                                 " --max-new-tokens 16 --stats");
  ASSERT_EQ(load.status, 0) << load.all();
  EXPECT_EQ(text_of(load), plain_text());
  // Another model cannot continue it; damaged files are refused.
  const CliResult foreign = run_cli("snapshot load --model " + quote(dir_ + "/other") + " --file " + quote(file));
  EXPECT_EQ(foreign.status, 2);
  EXPECT_NE(foreign.err.find("holds a state of model"), std::string::npos) << foreign.err;
  const std::string bytes = read_file(file);
  write_file(file, bytes.substr(0, bytes.size() - 9));
  const CliResult cut = run_cli("snapshot inspect --file " + quote(file));
  EXPECT_EQ(cut.status, 2);
  EXPECT_NE(cut.err.find("truncated"), std::string::npos) << cut.err;
  EXPECT_EQ(run_cli("snapshot load --model " + quote(dir_ + "/target") + " --file " + quote(file)).status, 2);
  EXPECT_EQ(run_cli("snapshot inspect --file " + quote(dir_ + "/missing")).status, 2);
}

// What a user can give and find, through the CLI: URLs of kinds the CLI
// does not speak are usage errors (never a local directory); every kind of
// junk under the entries' names is a miss with the same output, counted in
// --stats; ro:DIR reads a pre-built cache and writes nothing.
TEST_F(PrefixCli, UrlsJunkAndReadOnlyCaches) {
  const std::string base = "generate --model " + quote(dir_ + "/target") + " --prompt x ";
  for (const std::string url : {"rediss://127.0.0.1:6379", "REDIS://127.0.0.1:6379", "file:///tmp/x",
                                "redis:/127.0.0.1:6379", "http://h/x", "ro:redis://127.0.0.1:1"}) {
    SCOPED_TRACE(url);
    const CliResult r = run_cli(base + "--prefix-cache " + quote(url));
    EXPECT_EQ(r.status, 2) << r.all();
    EXPECT_NE(r.err.find("rewind: error: --prefix-cache '"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("accepted: a directory path, ro:DIR (a directory read but never written) or "
                         "redis://HOST:PORT[/PREFIX]"),
              std::string::npos)
        << r.err;
  }
  EXPECT_EQ(run_cli(base + "--prefix-cache ro:").status, 2);

  const std::string want = plain_text();
  const std::string cache = dir_ + "/junk_cache";
  ASSERT_EQ(run_cli(args(cache)).status, 0);
  const CliResult warm = run_cli(args(cache));
  ASSERT_EQ(warm.status, 0) << warm.all();
  const nlohmann::json pc = stats_of(warm)["prefix_cache"];
  EXPECT_EQ(pc["lookups"], 1);
  EXPECT_EQ(pc["hits"], 1);
  EXPECT_EQ(pc["misses"], 0);
  EXPECT_EQ(pc["entries_read"], 11);  // 64, 128, ..., 640 and 701
  EXPECT_EQ(pc["entries_rejected"], 0);

  // Read-only: a full hit, nothing written (not even times), counted.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(cache)) names.push_back(e.path().filename().string());
  const auto when = fs::last_write_time(cache + "/" + names[0]);
  const CliResult ro = run_cli(args("ro:" + cache));
  ASSERT_EQ(ro.status, 0) << ro.all();
  EXPECT_EQ(text_of(ro), want);
  EXPECT_EQ(stats_of(ro)["prefix_hit_tokens"], 701);
  EXPECT_EQ(stats_of(ro)["prefix_cache"]["entries_written"], 0);
  EXPECT_EQ(fs::last_write_time(cache + "/" + names[0]), when);
  // A read-only cache that misses stores nothing: writes are refused, counted.
  const CliResult ro_miss = run_cli("generate --model " + quote(dir_ + "/target") +
                                    " --prompt 'another prompt' --max-new-tokens 4 --stats --prefix-cache " +
                                    quote("ro:" + cache));
  ASSERT_EQ(ro_miss.status, 0) << ro_miss.all();
  EXPECT_GE(stats_of(ro_miss)["prefix_cache"]["writes_refused"], 1);
  std::size_t after = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(cache)) ++after;
  EXPECT_EQ(after, names.size());

  // Junk under every entry's name, each kind in turn: the same output, no
  // hit, rejections counted, never an error.
  std::sort(names.begin(), names.end());
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto kind = rwd::store_test::kEveryJunk[i % std::size(rwd::store_test::kEveryJunk)];
    rwd::store_test::make_junk(cache + "/" + names[i], kind, i);
  }
  const CliResult junk = run_cli(args("ro:" + cache));
  ASSERT_EQ(junk.status, 0) << junk.all();
  EXPECT_EQ(text_of(junk), want);
  EXPECT_EQ(stats_of(junk)["prefix_hit_tokens"], 0);
  EXPECT_GE(stats_of(junk)["prefix_cache"]["entries_rejected"], 1);
  EXPECT_EQ(stats_of(junk)["prefix_cache"]["store_errors"], 0);
  EXPECT_EQ(junk.err.find("error"), std::string::npos) << junk.err;
  // Written over (a directory named like an entry may refuse its put: a
  // warning, never a failure), then hit again.
  const CliResult rewrite = run_cli(args(cache));
  ASSERT_EQ(rewrite.status, 0) << rewrite.all();
  EXPECT_EQ(text_of(rewrite), want);
  EXPECT_EQ(rewrite.err.find("error:"), std::string::npos) << rewrite.err;

  // A 1 GiB sparse file under every entry's name: far below 2^32, but over
  // what an entry of at most 701 tokens of this model can hold, so each is
  // refused from its size and never read (no byte read, none corrupt).
  for (const std::string& name : names) {
    fs::remove_all(cache + "/" + name);
    std::ofstream(cache + "/" + name).put('x');
    fs::resize_file(cache + "/" + name, std::uintmax_t{1} << 30);
  }
  const CliResult big = run_cli(args("ro:" + cache));
  ASSERT_EQ(big.status, 0) << big.all();
  EXPECT_EQ(text_of(big), want);
  EXPECT_EQ(stats_of(big)["prefix_hit_tokens"], 0);
  EXPECT_GE(stats_of(big)["prefix_cache"]["rejected_unusable"], 1);
  EXPECT_EQ(stats_of(big)["prefix_cache"]["rejected_corrupt"], 0);
  EXPECT_EQ(stats_of(big)["prefix_cache"]["bytes_read"], 0);
}
#endif

}  // namespace
}  // namespace rwd::runtime
