// server/server.h: `rewind serve`, an OpenAI-compatible HTTP server over the
// reference runtime (docs/server.md).
//
// One decode thread owns the model's SequenceCache and runs continuous
// batching: every round is one Model::forward_batch over the sequences
// decoding now; requests join between rounds (their prompts fed in pieces
// of max_prefill_rows, shared by the joining prompts) and leave when they
// finish, are cancelled (a stop string matched, the client went away) or
// fail. The forward is batch invariant, so a request's tokens equal
// runtime::generate()'s for its prompt alone with the same sampling
// parameters and seed, whatever else is in the batch. A joining prompt
// starts from the longest prefix its prefix cache holds (in-process, or a
// directory or Redis shared with other servers) and stores an entry at each
// of the cache's boundaries it reaches; the tokens are the same with or
// without a hit. With speculation
// (ServerOptions::draft_dir / lookup) every request drafts, verifies and
// rolls back on its own within the same rounds; greedy tokens are still
// generate()'s.
//
// HTTP (cpp-httplib): a pool of `http_threads` threads parses requests and
// writes responses; a streaming response holds its thread while it streams.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "runtime/model.h"

namespace rwd::server {

struct ServerOptions {
  std::string model_dir;  // a model directory as `rewind generate --model` takes
  // The id /v1/models reports and requests' "model" must name; empty: the
  // model directory's last path component.
  std::string model_name;
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: a free port, chosen at start() (Server::port())
  // Sequences decoding at once (>= 1); more requests wait in the queue.
  std::int64_t max_batch = 8;
  // OpenMP threads of the decode loop's forwards (0: the OpenMP default).
  int threads = 0;
  // Threads that serve HTTP connections (>= 1); each streaming client holds one.
  int http_threads = 16;
  // Request bodies past this many bytes are refused with 413.
  std::size_t max_body_bytes = 1 << 20;
  // Requests waiting for a place in the batch past which new ones get 429.
  std::int64_t queue_limit = 256;
  // Positions a request may use, prompt + max_tokens (0: the model's
  // max_position_embeddings, or kDefaultContext when the config names none).
  std::int64_t context = 0;
  // Prompt tokens one forward feeds at most (runtime::GenerationOptions).
  std::int64_t max_prefill_rows = 2048;
  // How the model holds its linear weights (runtime::LoadOptions); a draft
  // model is loaded the same way.
  runtime::LoadOptions load;
  // Prefix reuse (docs/server.md): a request's prompt starts from the
  // longest prefix stored by an earlier request, of this server or of any
  // other on the same store; output is identical with and without a hit.
  // False: none.
  bool prefix_reuse = true;
  // Where entries live: empty, an in-process store of prefix_cache_bytes
  // (kDefaultPrefixCacheBytes when unset); otherwise what `rewind generate
  // --prefix-cache` takes (rewind/open_store.h): a directory, ro:DIR or
  // redis://HOST:PORT[/PREFIX], which several servers may share.
  std::string prefix_cache;
  // An entry every this many prompt tokens (and at each prompt's end).
  std::int64_t prefix_interval = 256;
  // The cap in bytes of the in-process store or of a directory store (least
  // recently used entries go first; 0: none); refused for Redis and ro:DIR.
  std::optional<std::size_t> prefix_cache_bytes;
  // Speculative decoding of every request (docs/server.md, "Speculation"):
  // a draft model directory whose vocabulary is the model's, or prompt
  // lookup with n-grams of up to `lookup` tokens in [1, runtime::kMaxDraft];
  // not both. Empty and 0: plain decoding.
  std::string draft_dir;
  std::int64_t lookup = 0;
  // Draft tokens per round K, in [1, runtime::kMaxDraft]; with adaptive, the
  // most K grows to (runtime::SpeculativeOptions, per request).
  std::int64_t num_draft = 4;
  bool adaptive = false;
};

// The in-process prefix store's cap when ServerOptions::prefix_cache_bytes
// is unset.
inline constexpr std::size_t kDefaultPrefixCacheBytes = std::size_t{1} << 30;

// The context used when neither ServerOptions::context nor the model's
// config names one.
inline constexpr std::int64_t kDefaultContext = 4096;

// What the server has done so far (also GET /metrics).
struct ServerCounters {
  std::int64_t requests = 0;          // HTTP requests answered (any status)
  std::int64_t completions = 0;       // POST /v1/completions answered (any status)
  std::int64_t cancelled = 0;         // generation requests whose client went away before the end
  std::int64_t prompt_tokens = 0;     // prompt tokens of admitted requests
  std::int64_t generated_tokens = 0;  // tokens the decode loop emitted
  std::int64_t forwards = 0;          // batched forwards
  std::int64_t forks = 0;             // choices forked from a request's prefilled prompt (n > 1)
  std::int64_t waiting = 0;           // requests in the queue now
  std::int64_t running = 0;           // sequences in the batch now
  std::int64_t peak_batch = 0;        // the most sequences one forward held
  std::int64_t live_sequences = 0;    // sequences in the SequenceCache now
  // The decode loop's SequenceCache (SequenceMemory), after its last round:
  // what its live sequences use, and everything it holds, free blocks kept
  // for the next requests included.
  std::size_t cache_bytes_used = 0;
  std::size_t cache_bytes_reserved = 0;
  // Prefix reuse (all 0 without it).
  std::int64_t prefix_lookups = 0;          // admitted prompts looked up in the prefix cache
  std::int64_t prefix_hits = 0;             // admitted requests that started from a stored prefix
  std::int64_t prefix_hit_tokens = 0;       // prompt tokens restored instead of computed
  std::int64_t prefix_entries_written = 0;  // entries the store took
  std::int64_t prefix_store_errors = 0;     // store calls that failed (each a miss or an entry not kept)
  std::int64_t drafted = 0;                 // draft tokens proposed for verification (speculation)
  std::int64_t accepted = 0;                // of those, tokens the model accepted
};

class Server {
 public:
  // Loads the model and its tokenizer (and the draft model) and opens the
  // prefix cache. Throws InvalidArgument naming the option for a bad option
  // (max_batch < 1, http_threads < 1, queue_limit < 1, context < 0 or past
  // the model's max_position_embeddings, max_prefill_rows < 1, num_draft or
  // lookup out of range, draft_dir with lookup, a draft model whose
  // vocabulary or tokenizer differs from the model's, a prefix_cache that is
  // not a directory, ro:DIR or redis:// URL, prefix_interval outside [1,
  // 2^40], prefix_cache_bytes for Redis or ro:DIR), and what Model::load /
  // tokenizer_for_model throw. A prefix store that cannot be reached now (a
  // Redis server down) is a warning on stderr and no prefix reuse.
  explicit Server(ServerOptions options);
  // stop()s a running server.
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds host:port and starts the decode thread and the HTTP listener;
  // returns the port bound (the one chosen for port 0). Throws
  // InvalidArgument naming host and port when the address cannot be bound,
  // StateError when started before (a Server starts once).
  int start();
  // Drains and stops: new requests get 503, requests already admitted run
  // to their end and streams finish writing them (a stream still open 30 s
  // after the last token is cut), then the listener and the decode thread
  // stop. Idempotent; returns at once when not started.
  void stop();
  // The port bound by start() (0 before).
  int port() const;
  // The model id (ServerOptions::model_name or its default).
  const std::string& model_name() const;
  ServerCounters counters() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace rwd::server
