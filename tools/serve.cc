// rewind serve: the OpenAI-compatible HTTP server (server/server.h,
// docs/server.md) until SIGTERM or SIGINT, which drain the requests under
// way and exit 0.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <string>

#include <pthread.h>

#include "common.h"
#include "rewind/error.h"

#ifdef REWIND_HAVE_SERVER
#include "server/server.h"
#endif

namespace rwd::cli {
namespace {

struct ServeFlags {
  std::string model_dir;
  std::string model_name;
  std::string host = "127.0.0.1";
  int port = 8080;
  std::int64_t max_batch = 8;
  int http_threads = 16;
  std::int64_t max_body = 1 << 20;
  std::int64_t queue_limit = 256;
  std::optional<std::int64_t> ctx_size;
  std::string prefix_cache;
  bool no_prefix_cache = false;
  std::int64_t prefix_interval = 256;
  std::optional<std::int64_t> prefix_cache_bytes;
  std::string draft_dir;
  std::int64_t lookup = 0;
  std::int64_t num_draft = 4;
  bool adaptive = false;
};

#ifdef REWIND_HAVE_SERVER
int run_serve(const ServeFlags& f, const std::optional<int>& threads) {
  server::ServerOptions o;
  o.model_dir = f.model_dir;
  o.model_name = f.model_name;
  o.load = load_options();
  o.host = f.host;
  o.port = f.port;
  o.max_batch = f.max_batch;
  o.http_threads = f.http_threads;
  o.max_body_bytes = static_cast<std::size_t>(f.max_body);
  o.queue_limit = f.queue_limit;
  o.context = f.ctx_size.value_or(0);
  o.prefix_reuse = !f.no_prefix_cache;
  o.prefix_cache = f.prefix_cache;
  o.prefix_interval = f.prefix_interval;
  if (f.prefix_cache_bytes) o.prefix_cache_bytes = static_cast<std::size_t>(*f.prefix_cache_bytes);
  o.draft_dir = f.draft_dir;
  o.lookup = f.lookup;
  o.num_draft = f.num_draft;
  o.adaptive = f.adaptive;
  // The decode loop runs on a thread of its own, which does not inherit
  // main's omp_set_num_threads: the CLI's thread rule is passed explicitly.
  const char* env = std::getenv("OMP_NUM_THREADS");
  o.threads = threads ? *threads : (env != nullptr && *env != '\0') ? 0 : 1;
  server::Server server(o);
  // Blocked before any thread starts, so that every thread inherits the mask
  // and the signals wait for sigwait below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  const int port = server.start();
  std::string speculation;
  if (!f.draft_dir.empty()) speculation = ", draft model " + f.draft_dir;
  if (f.lookup > 0) speculation = ", prompt lookup n <= " + std::to_string(f.lookup);
  if (!speculation.empty()) speculation += ", K " + std::to_string(f.num_draft) + (f.adaptive ? " adaptive" : "");
  std::fprintf(stderr, "rewind serve: model %s on http://%s:%d (max batch %lld%s)\n", server.model_name().c_str(),
               f.host.c_str(), port, static_cast<long long>(f.max_batch), speculation.c_str());
  std::fflush(stderr);
  int sig = 0;
  sigwait(&stop_signals, &sig);
  std::fprintf(stderr, "rewind serve: %s, draining the requests under way\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  std::fflush(stderr);
  server.stop();
  return 0;
}
#else
int run_serve(const ServeFlags&, const std::optional<int>&) {
  throw InvalidArgument(
      "this rewind was built without the HTTP server (it needs cpp-httplib: apt-get install libcpp-httplib-dev, "
      "then configure again with -DREWIND_BUILD_SERVER=ON)");
}
#endif

}  // namespace

Command add_serve_command(CLI::App& app, SharedFlags& shared) {
  auto flags = std::make_shared<ServeFlags>();
  ServeFlags& f = *flags;
  auto* cmd = app.add_subcommand("serve",
                                 "an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, streaming)");
  add_model_option(cmd, f.model_dir);
  cmd->add_option("--model-name", f.model_name,
                  "the model id /v1/models reports and requests name (default: the model directory's name)");
  cmd->add_option("--host", f.host, "address to listen on (0.0.0.0: every interface)");
  cmd->add_option("--port", f.port, "port to listen on (0: a free one, printed at start)")->check(integer_in(0, 65535));
  cmd->add_option("--max-batch", f.max_batch, "sequences decoding at once; later requests wait and join")
      ->check(integer_in(1, 4096));
  add_weights_option(cmd, shared);
  add_threads_option(cmd, shared.threads);
  cmd->add_option("--http-threads", f.http_threads, "threads serving connections (a streaming client holds one)")
      ->check(integer_in(1, 4096));
  cmd->add_option("--max-body-size", f.max_body, "largest request body in bytes (larger: 413)")
      ->check(integer_in(1, std::int64_t{1} << 32));
  cmd->add_option("--queue-limit", f.queue_limit, "requests waiting for the batch past which new ones get 429")
      ->check(integer_in(1, std::int64_t{1} << 30));
  cmd->add_option("-c,--ctx-size", f.ctx_size,
                  "positions a request may use (prompt + max_tokens); default the model's "
                  "max_position_embeddings, 4096 when its config names none")
      ->check(integer_in(1, std::int64_t{1} << 40));
  auto* prefix = cmd->add_option("--prefix-cache", f.prefix_cache,
                                 "where prompt-prefix entries live, shared by every server (replica) given the same "
                                 "one: a directory, ro:DIR (read, never written) or redis://HOST:PORT[/PREFIX], as "
                                 "generate --prefix-cache takes; other URLs are refused. Default: in this process "
                                 "(1 GiB, least recently used entries go first). A request's prompt starts from the "
                                 "longest stored prefix; output is identical with or without a hit. A store that "
                                 "fails is one warning and recomputation")
                     ->type_name("DIR|ro:DIR|URL")
                     ->default_str("in-process");
  auto* off = cmd->add_flag("--no-prefix-cache", f.no_prefix_cache, "no prefix reuse: every prompt is computed")
                  ->excludes(prefix);
  cmd->add_option("--prefix-interval", f.prefix_interval, "tokens between prefix-cache entries")
      ->check(integer_in(1, std::int64_t{1} << 40))
      ->excludes(off);
  cmd->add_option("--prefix-cache-bytes", f.prefix_cache_bytes,
                  "cap of the in-process or directory prefix cache in bytes; least recently used entries go first "
                  "(0: no cap)")
      ->check(integer_in(0, std::int64_t{1} << 50))
      ->excludes(off);
  // generate's speculation flags, same names and meaning (no --tree: the
  // server speculates in chains).
  auto* d = cmd->add_option("--draft", f.draft_dir,
                            "speculate every request with this draft model (same vocabulary; it drafts greedily)")
                ->check(CLI::ExistingDirectory)
                ->default_str("none");
  auto* l = cmd->add_option("--lookup", f.lookup, "speculate every request with prompt lookup, n-grams up to N")
                ->check(integer_in(1, 64))
                ->default_str("off");
  d->excludes(l);
  cmd->add_option("--num-draft", f.num_draft, "draft tokens per round K; needs --draft or --lookup")
      ->check(integer_in(1, 64));
  cmd->add_flag("--adaptive", f.adaptive,
                "adapt each request's K from its acceptance (K is the maximum); needs --draft or --lookup");
  return {cmd, [cmd, flags, &shared] {
            const ServeFlags& o = *flags;
            if (o.draft_dir.empty() && o.lookup == 0) {
              for (const char* flag : {"--num-draft", "--adaptive"}) {
                if (cmd->count(flag) > 0) {
                  throw InvalidArgument(std::string(flag) + " applies to speculative decoding: it needs a draft " +
                                        "source, --draft DIR or --lookup N");
                }
              }
            }
            return run_serve(o, shared.threads);
          }};
}

}  // namespace rwd::cli
