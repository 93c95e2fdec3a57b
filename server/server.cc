#include "server/server.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <deque>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "rewind/error.h"
#include "rewind/open_store.h"
#include "rewind/prefix_cache.h"
#include "rewind/sequences.h"
#include "rewind/store.h"
#include "runtime/chat_template.h"
#include "runtime/generate.h"
#include "runtime/kernels.h"
#include "runtime/model.h"
#include "runtime/tokenizer.h"
#include "server/chat_output.h"
#include "server/connection.h"
#include "server/stop_strings.h"

namespace rwd::server {

using json = nlohmann::json;
using runtime::LogitRows;
using runtime::Model;
using runtime::SamplingParams;
using runtime::SequenceTokens;
using runtime::Tokenizer;

namespace {

// How long stop() lets open streams finish writing before it cuts them.
constexpr std::chrono::seconds kStreamDrainLimit{30};
// How often a request that writes nothing (queued, prefilling, or waiting
// for its whole answer) asks whether its client is still there.
constexpr std::chrono::milliseconds kClientPoll{100};

// Thrown by Completion::next when the request's client has left.
struct ClientGone {};

// A request refused with an OpenAI-style error body:
// {"error": {"message", "type", "param", "code"}}.
class ApiError : public InvalidArgument {
 public:
  ApiError(int status, std::string message, std::string param = {}, std::string code = {},
           std::string type = "invalid_request_error")
      : InvalidArgument(message), status_(status), param_(std::move(param)), code_(std::move(code)),
        type_(std::move(type)) {}
  int status() const { return status_; }
  json body() const {
    return {{"error",
             {{"message", what()},
              {"type", type_},
              {"param", param_.empty() ? json(nullptr) : json(param_)},
              {"code", code_.empty() ? json(nullptr) : json(code_)}}}};
  }

 private:
  int status_;
  std::string param_, code_, type_;
};

// Text that may hold bytes that are not UTF-8 (a byte-level model's output)
// goes out with U+FFFD in their place.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_json(httplib::Response& res, int status, const json& j) {
  res.status = status;
  res.set_content(dump(j), "application/json");
}

// ---- request fields ---------------------------------------------------------

// The field `key` of `body`, or null when absent or JSON null (OpenAI
// clients send null for an unset optional field).
const json* field(const json& body, const char* key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

[[noreturn]] void wrong_type(const char* key, const char* expected, const json& value) {
  throw ApiError(
      400,
      std::string("'") + key + "' must be " + expected + ", got " + value.type_name() + " " + dump(value).substr(0, 64),
      key, "invalid_type");
}

std::optional<std::int64_t> integer_field(const json& body, const char* key, std::int64_t lo, std::int64_t hi) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) wrong_type(key, "an integer", *v);
  if (v->is_number_unsigned() && v->get<std::uint64_t>() > static_cast<std::uint64_t>(hi)) {
    throw ApiError(400,
                   std::string("'") + key + "' is " + v->dump() + ", past the largest allowed, " + std::to_string(hi),
                   key, "invalid_value");
  }
  const auto x = v->get<std::int64_t>();
  if (x < lo || x > hi) {
    throw ApiError(400,
                   std::string("'") + key + "' is " + std::to_string(x) + "; allowed: " + std::to_string(lo) + " to " +
                       std::to_string(hi),
                   key, "invalid_value");
  }
  return x;
}

// A number in [lo, hi] (lo excluded when lo_open).
std::optional<double> number_field(const json& body, const char* key, double lo, double hi, bool lo_open) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(key, "a number", *v);
  const auto x = v->get<double>();
  if (!(lo_open ? x > lo : x >= lo) || !(x <= hi)) {
    throw ApiError(400,
                   std::string("'") + key + "' is " + v->dump() + "; allowed: " + (lo_open ? "above " : "") +
                       json(lo).dump() + " to " + json(hi).dump(),
                   key, "invalid_value");
  }
  return x;
}

std::optional<bool> bool_field(const json& body, const char* key) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) wrong_type(key, "a boolean", *v);
  return v->get<bool>();
}

// What a completion request asks for, validated.
struct CompletionRequest {
  std::vector<std::int32_t> prompt;
  std::int64_t max_tokens = 16;  // OpenAI's default for /v1/completions
  SamplingParams sampling;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;
  std::int64_t n = 1;  // choices: n - 1 of them forked from the first once its prompt is in
};

json parse_body(const httplib::Request& req) {
  json body;
  try {
    body = json::parse(req.body);
  } catch (const json::parse_error& e) {
    throw ApiError(400, std::string("the request body is not valid JSON: ") + e.what(), {}, "invalid_json");
  }
  if (!body.is_object()) {
    throw ApiError(400, std::string("the request body must be a JSON object, got ") + body.type_name(), {},
                   "invalid_json");
  }
  return body;
}

void check_model(const json& body, const std::string& name) {
  const json* v = field(body, "model");
  if (!v) return;  // one model is served: an unnamed one is that one
  if (!v->is_string()) wrong_type("model", "a string", *v);
  if (v->get<std::string>() != name) {
    throw ApiError(404, "the model '" + v->get<std::string>() + "' does not exist; this server serves '" + name + "'",
                   "model", "model_not_found");
  }
}

std::vector<std::int32_t> parse_prompt(const json& body, const Tokenizer& tokenizer, std::int64_t vocab) {
  const json* v = field(body, "prompt");
  if (!v) throw ApiError(400, "'prompt' is required: a string or a list of token ids", "prompt", "missing_field");
  const json* text = v;
  if (v->is_array() && !v->empty() && (*v)[0].is_string()) {
    if (v->size() != 1) {
      throw ApiError(400,
                     "'prompt' lists " + std::to_string(v->size()) +
                         " strings; one prompt per request is supported (send several requests)",
                     "prompt", "unsupported_value");
    }
    text = &(*v)[0];
  }
  if (text->is_string()) {
    std::vector<std::int32_t> ids;
    try {
      ids = tokenizer.encode(text->get<std::string>(), true);
    } catch (const InvalidArgument& e) {
      throw ApiError(400, std::string("'prompt' cannot be tokenized: ") + e.what(), "prompt", "invalid_value");
    }
    if (ids.empty()) {
      throw ApiError(400, "'prompt' encodes to no token (this tokenizer adds no BOS); give some text", "prompt",
                     "invalid_value");
    }
    return ids;
  }
  if (!v->is_array()) wrong_type("prompt", "a string or a list of token ids", *v);
  if (v->empty())
    throw ApiError(400, "'prompt' is an empty list; give at least one token id", "prompt", "invalid_value");
  std::vector<std::int32_t> ids;
  for (std::size_t i = 0; i < v->size(); ++i) {
    const json& t = (*v)[i];
    if (!t.is_number_integer()) {
      throw ApiError(400,
                     "'prompt' item " + std::to_string(i) + " must be a token id (an integer), got " + t.type_name() +
                         "; nested lists (several prompts) are not supported",
                     "prompt", "invalid_type");
    }
    const bool in_range = t.is_number_unsigned() ? t.get<std::uint64_t>() < static_cast<std::uint64_t>(vocab)
                                                 : t.get<std::int64_t>() >= 0 && t.get<std::int64_t>() < vocab;
    if (!in_range) {
      throw ApiError(400,
                     "'prompt' item " + std::to_string(i) + " is token " + t.dump() + ", outside the vocabulary [0, " +
                         std::to_string(vocab) + ")",
                     "prompt", "invalid_value");
    }
    ids.push_back(static_cast<std::int32_t>(t.get<std::int64_t>()));
  }
  return ids;
}

// The fields /v1/completions and /v1/chat/completions share (all but the
// prompt), into `r`. `max_n` is the server's max_batch: a request's choices
// decode together, each a place in the batch (speculating or not).
void parse_generation(const json& body, std::int64_t context, std::int64_t max_n, CompletionRequest& r) {
  // Past max_batch a request could never be admitted whole.
  if (auto n = integer_field(body, "n", 1, max_n)) r.n = *n;
  if (auto echo = bool_field(body, "echo"); echo && *echo) {
    throw ApiError(400, "'echo' is not supported yet", "echo", "unsupported_value");
  }
  if (auto m = integer_field(body, "max_tokens", 0, context)) r.max_tokens = *m;
  r.sampling.temperature = 1.0f;  // OpenAI's default: sampling
  if (auto t = number_field(body, "temperature", 0.0, 2.0, false)) r.sampling.temperature = static_cast<float>(*t);
  if (auto p = number_field(body, "top_p", 0.0, 1.0, true)) r.sampling.top_p = static_cast<float>(*p);
  // top_k is vLLM's and llama.cpp's extension; -1 (vLLM) and 0 mean no filter.
  if (auto k = integer_field(body, "top_k", -1, std::int64_t{1} << 31))
    r.sampling.top_k = std::max<std::int64_t>(*k, 0);
  if (const json* s = field(body, "seed")) {
    if (!s->is_number_integer()) wrong_type("seed", "an integer", *s);
    r.sampling.seed = s->is_number_unsigned() ? s->get<std::uint64_t>()
                                              : static_cast<std::uint64_t>(s->get<std::int64_t>());
  } else {
    r.sampling.seed = std::random_device{}() ^ (static_cast<std::uint64_t>(std::random_device{}()) << 32);
  }
  if (const json* s = field(body, "stop")) {
    if (s->is_string()) {
      r.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      for (const json& item : *s) {
        if (!item.is_string()) wrong_type("stop", "a string or a list of strings", *s);
        r.stop.push_back(item.get<std::string>());
      }
    } else {
      wrong_type("stop", "a string or a list of strings", *s);
    }
    for (const std::string& stop : r.stop) {
      if (stop.empty())
        throw ApiError(400, "'stop' holds an empty string; every stop string needs a character", "stop",
                       "invalid_value");
    }
  }
  if (auto s = bool_field(body, "stream")) r.stream = *s;
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) wrong_type("stream_options", "an object", *so);
    if (auto u = bool_field(*so, "include_usage")) r.include_usage = *u;
  }
}

void check_context(const CompletionRequest& r, std::int64_t context) {
  const auto P = static_cast<std::int64_t>(r.prompt.size());
  if (P + r.max_tokens > context) {
    throw ApiError(400,
                   "this model's maximum context length is " + std::to_string(context) + " tokens; the prompt has " +
                       std::to_string(P) + " tokens and max_tokens asks for " + std::to_string(r.max_tokens) +
                       " more (" + std::to_string(P + r.max_tokens) + "); shorten the prompt or lower max_tokens",
                   P > context ? "prompt" : "max_tokens", "context_length_exceeded");
  }
}

CompletionRequest parse_completion(const json& body, const Tokenizer& tokenizer, std::int64_t vocab,
                                   std::int64_t context, std::int64_t max_n) {
  CompletionRequest r;
  // Generation fields first, so that a bad one is reported whatever the prompt.
  parse_generation(body, context, max_n, r);
  r.prompt = parse_prompt(body, tokenizer, vocab);
  check_context(r, context);
  return r;
}

// ---- chat requests ------------------------------------------------------------

using ordered_json = nlohmann::ordered_json;

[[noreturn]] void bad_message(std::size_t i, const std::string& what, const char* code = "invalid_type") {
  throw ApiError(400, "'messages' item " + std::to_string(i) + " " + what, "messages", code);
}

// The messages of a chat request, checked, as the template receives them:
// every message an object with a string role and string content (a list of
// text parts is joined; null or absent only beside tool_calls, then ""), the
// other fields (tool_calls, reasoning_content, name, ...) as sent, in order.
ordered_json chat_messages(const ordered_json& body) {
  const auto it = body.find("messages");
  if (it == body.end() || it->is_null()) {
    throw ApiError(400, "'messages' is required: a list of {role, content} objects", "messages", "missing_field");
  }
  if (!it->is_array()) {
    throw ApiError(400, std::string("'messages' must be a list of {role, content} objects, got ") + it->type_name(),
                   "messages", "invalid_type");
  }
  if (it->empty())
    throw ApiError(400, "'messages' is an empty list; give at least one message", "messages", "invalid_value");
  ordered_json out = ordered_json::array();
  for (std::size_t i = 0; i < it->size(); ++i) {
    ordered_json m = (*it)[i];
    if (!m.is_object()) bad_message(i, std::string("must be an object {role, content}, got ") + m.type_name());
    const auto role = m.find("role");
    if (role == m.end() || role->is_null()) bad_message(i, "has no 'role'", "missing_field");
    if (!role->is_string()) bad_message(i, std::string("has a 'role' that is not a string: ") + role->type_name());
    const auto calls = m.find("tool_calls");
    const bool has_calls = calls != m.end() && !calls->is_null();
    if (has_calls && !calls->is_array()) bad_message(i, "has 'tool_calls' that is not a list");
    if (calls != m.end() && calls->is_null()) m.erase("tool_calls");
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) {
      if (!has_calls)
        bad_message(i, "has no 'content' (only an assistant message with tool_calls may omit it)", "missing_field");
      m["content"] = "";
    } else if (content->is_array()) {
      std::string text;
      for (const ordered_json& part : *content) {
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
            !part["text"].is_string()) {
          bad_message(i,
                      "has a content part that is not {\"type\": \"text\", \"text\": string}; only text is supported",
                      "unsupported_value");
        }
        text += part["text"].get<std::string>();
      }
      *content = text;
    } else if (!content->is_string()) {
      bad_message(i,
                  std::string("has a 'content' that is not a string or a list of text parts: ") + content->type_name());
    }
    out.push_back(std::move(m));
  }
  return out;
}

// ---- the decode loop's jobs ---------------------------------------------------

// What the HTTP thread of a request waits on: every choice of the request
// publishes under the one mutex and wakes the one reader.
struct Channel {
  std::mutex mu;
  std::condition_variable cv;
};

// One choice of a generation request. The HTTP thread fills the request
// part, submits it and reads `tokens` as the decode loop appends them;
// `cancel` asks the decode loop to drop the sequence (a stop string
// matched, the client left). With n > 1 the first choice holds the others
// in `forks` until its prompt (speculating: all but its last token) is in
// the cache; each is then forked from its sequence (copy-on-write, no
// prompt of its own) and decodes (or speculates) on its own.
struct Job {
  std::vector<std::int32_t> prompt;
  std::int64_t max_tokens = 0;
  SamplingParams sampling;
  std::vector<std::shared_ptr<Job>> forks;  // the other choices, until forked
  std::shared_ptr<Channel> channel;         // the request's, shared by its choices

  // Decode-loop state.
  SeqId id;
  std::vector<std::int32_t> pending;  // tokens the next forward feeds
  std::mt19937_64 rng;
  std::int64_t emitted = 0;
  // Prefix reuse: the prompt tokens in the cache (restored or fed), where
  // the prefix-cache entry under way begins, and the boundaries still ahead
  // in the prompt but its last token (ascending; a piece never crosses one,
  // an entry is stored at each).
  std::int64_t in_cache = 0;
  std::int64_t entry_from = 0;
  std::deque<std::int64_t> boundaries;
  // Speculation (Speculation below): the sequence so far, prompt + emitted,
  // whose last token is the pending one the next verify forward leads with;
  // whether the prompt but that token is in the cache; this round's drafts;
  // the draft length K now (adaptive) and the request's draft-model slot.
  std::vector<std::int32_t> sequence;
  bool prefilled = false;
  std::vector<std::int32_t> drafts;
  std::int64_t k_now = 0;
  std::size_t slot = 0;

  std::vector<std::int32_t> tokens;  // under channel->mu
  bool done = false;                 // under channel->mu
  std::string finish_reason;         // under channel->mu: "stop" (EOS) or "length"; with error: "error"
  std::string error;                 // under channel->mu
  std::atomic<bool> cancel{false};
};

// Per-request speculation in the decode loop (ServerOptions::draft_dir /
// lookup), as runtime::speculative_generate_batch does it: each round a
// request that decodes drafts up to its own K tokens (prompt lookup over its
// sequence, or the draft model, whose per-request sequences live in the
// draft's own SequenceCache and are fed and cropped as runtime::ModelDraft
// does, every draft step one batched forward), the verify forward scores
// the pending token and the drafts, and accept() keeps what
// runtime::accept_drafts keeps and crops the rest from the request's
// sequence alone. The draft model drafts greedily for every request, a
// sampled one included: a deterministic draft is exact under speculative
// sampling (its q is one-hot), needs no per-request draft temperature, and
// keeps a seeded request's tokens independent of the rest of the batch.
class Speculation {
 public:
  Speculation(const ServerOptions& o, const Model* draft, const Model& target)
      : num_draft_(o.num_draft), adaptive_(o.adaptive), V_(target.vocab_size()) {
    if (o.lookup > 0) lookup_.emplace(o.lookup);
    if (draft) {
      drafter_.emplace(*draft, SamplingParams{}, o.num_draft, o.max_prefill_rows);
      drafter_->begin(std::vector<std::vector<std::int32_t>>(static_cast<std::size_t>(o.max_batch)));
      for (auto i = static_cast<std::size_t>(o.max_batch); i-- > 0;) free_slots_.push_back(i);
    }
  }
  bool on() const { return lookup_.has_value() || drafter_.has_value(); }

  // A request joins, the first `restored` tokens of its prompt in the cache
  // (restored from the prefix cache; at most all but the last): the target
  // keeps a round's worth of rollback record for it, and the rest of its
  // prompt but the last token is what it feeds first.
  void join(Job& job, SequenceCache& cache, std::int64_t restored) {
    cache.activate_past_recording(job.id, num_draft_);
    job.sequence = job.prompt;
    job.pending.assign(job.prompt.begin() + restored, job.prompt.end() - 1);
    job.prefilled = job.pending.empty();
    job.k_now = num_draft_;
    if (drafter_) {
      job.slot = free_slots_.back();  // the batch never holds more than max_batch
      free_slots_.pop_back();
    }
  }
  // A choice forked (SequenceCache::fork) from `first` once its prompt but
  // the last token is in joins as a request would after that prefill: the
  // fork holds the recording `first` activated (fork copies it), its own K
  // and a draft-model slot of its own, which prefills the prompt at its first
  // propose as a fresh request's does. Its tokens are then those of a
  // request alone with its seed.
  void join_fork(Job& fork, const Job& first) {
    fork.sequence = first.prompt;
    fork.pending.clear();
    fork.drafts.clear();
    fork.prefilled = true;
    fork.k_now = num_draft_;
    if (drafter_) {
      fork.slot = free_slots_.back();  // the request's places include its forks: a slot is free
      free_slots_.pop_back();
    }
  }
  // A request leaves: its draft state goes back.
  void leave(Job& job) {
    if (!drafter_) return;
    drafter_->finish(job.slot);
    free_slots_.push_back(job.slot);
  }

  // This round's drafts of the requests of `active` past their prefill,
  // at most K each and never more than the tokens the request may still
  // emit less one (a round emits the accepted drafts and one more); each
  // one's pending becomes its verify tokens, the pending token then the
  // drafts.
  void draft(const std::vector<std::shared_ptr<Job>>& active) {
    std::vector<Job*> jobs;
    for (const auto& job : active)
      if (job->prefilled) jobs.push_back(job.get());
    std::vector<runtime::BatchDraftSource::Request> requests;
    for (Job* job : jobs) {
      job->drafts.clear();
      const std::int64_t k = std::min(job->k_now, job->max_tokens - job->emitted - 1);
      if (k <= 0) continue;
      if (lookup_) {
        job->drafts = lookup_->propose(job->sequence, k, nullptr);
      } else {
        requests.push_back({job->slot, job->sequence, k, &job->drafts, nullptr});
      }
    }
    if (!requests.empty()) drafter_->propose(requests);
    for (Job* job : jobs) {
      job->pending.assign(1, job->sequence.back());
      job->pending.insert(job->pending.end(), job->drafts.begin(), job->drafts.end());
    }
  }

  // After the verify forward (`logits`: a row per verify token): the tokens
  // the round emits, the rejected drafts cropped from the job's sequence
  // (crop(0) too, so that sliding and conv states shrink back) and the
  // draft told. Sets `accepted`.
  std::vector<std::int32_t> accept(Job& job, std::span<const float> logits, SequenceCache& cache,
                                   std::int64_t& accepted) {
    const std::vector<std::int32_t> emitted = runtime::accept_drafts(logits, V_, job.drafts, {}, job.sampling, job.rng,
                                                                     accepted);
    const auto kd = static_cast<std::int64_t>(job.drafts.size());
    cache.crop(job.id, -(kd - accepted));
    if (drafter_ && kd > 0) drafter_->accept(job.slot, kd, accepted);
    if (adaptive_ && kd > 0) {
      job.k_now = accepted == kd ? std::min(job.k_now + 2, num_draft_) : std::max<std::int64_t>(job.k_now - 1, 1);
    }
    return emitted;
  }

 private:
  std::int64_t num_draft_;
  bool adaptive_;
  std::int64_t V_;
  std::optional<runtime::LookupDraft> lookup_;
  std::optional<runtime::BatchedModelDraft> drafter_;
  std::vector<std::size_t> free_slots_;  // draft-model slots no request holds
};

}  // namespace

struct Server::Impl {
  ServerOptions options;
  std::string name;
  Model model;
  Tokenizer tokenizer;
  std::optional<Model> draft;  // ServerOptions::draft_dir's model
  std::int64_t context = 0;
  // tokenizer_config.json's chat_template; when absent or unparsable, the
  // chat endpoint answers 400 and says why (chat_template_problem).
  std::optional<runtime::ChatTemplate> chat_template;
  std::string chat_template_problem;

  httplib::Server http;
  std::thread listener;
  std::thread decoder;
  int bound_port = 0;
  bool started = false;
  bool stopped = false;
  std::atomic<bool> listener_done{false};
  std::mutex lifecycle;

  // The queue and the decode loop's wake-up, under mu.
  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Job>> waiting;
  bool quit = false;
  // Streaming responses whose content provider has not been released yet;
  // stop() waits for them, since httplib's stop() cuts a stream mid-way.
  std::int64_t open_streams = 0;
  std::condition_variable streams_cv;
  ServerCounters counters;  // under mu
  std::atomic<std::uint64_t> next_id{1};
  // Used by the decode thread alone (PrefixCache is not thread-safe); its
  // figures reach counters after each use. Null: no prefix reuse.
  std::unique_ptr<PrefixCache> prefix;

  Impl(ServerOptions o, Model m, Tokenizer t) : options(std::move(o)), model(std::move(m)), tokenizer(std::move(t)) {}

  // ---- decode loop ----

  static void publish(Job& job, std::int32_t token) {
    {
      std::lock_guard<std::mutex> lock(job.channel->mu);
      job.tokens.push_back(token);
    }
    job.channel->cv.notify_all();
  }
  static void finish(Job& job, std::string reason, std::string error = {}) {
    {
      std::lock_guard<std::mutex> lock(job.channel->mu);
      job.done = true;
      job.finish_reason = reason;
      job.error = error;
    }
    job.channel->cv.notify_all();
    // Choices not forked yet end with the first (its request failed, or
    // was cancelled, before its prompt was in).
    for (const auto& fork : job.forks) finish(*fork, reason, error);
    job.forks.clear();
  }

  // Gives `job` its sequence in `cache`: with prefix reuse, the longest
  // stored prefix of its prompt but the last token restored, the rest of
  // the prompt pending (fed in pieces that end at the prefix cache's
  // boundaries, prefill_piece), the last token to join the batch as a
  // decoding row does, or with speculation to lead its first verify
  // forward (Speculation::join, after the restore: the recording is the
  // sequence's). Returns false when the request failed (the system refused
  // the memory of its sequence or of its rollback record). A stored prefix
  // that does not fit (another shape under this fingerprint) or that the
  // store cannot deliver is recomputed.
  bool admit(Job& job, SequenceCache& cache, Speculation& spec) {
    try {
      job.id = cache.add_sequence();
    } catch (const std::exception& e) {
      finish(job, "error", e.what());
      return false;
    }
    job.rng.seed(job.sampling.seed);
    job.in_cache = job.entry_from = 0;
    job.boundaries.clear();
    const auto head = static_cast<std::int64_t>(job.prompt.size()) - 1;
    std::int64_t restored = 0;
    if (prefix && head >= 1) {
      const std::span<const std::int32_t> tokens = std::span<const std::int32_t>(job.prompt).first(head);
      try {
        const PrefixHit hit = prefix->lookup(tokens, false);
        if (hit.length > 0) {
          const SeqId id = cache.import_snapshot(hit.state);
          cache.seq_rm(job.id);
          job.id = id;
          restored = hit.length;
        }
      } catch (const Error&) {
        // InvalidArgument: an entry of another shape; CapacityError: no memory
        // for the restored state. Either way the prompt is computed.
      }
      const std::vector<std::int64_t> b = prefix->boundaries(restored, head);
      job.boundaries.assign(b.begin(), b.end());
      job.in_cache = job.entry_from = restored;
      std::lock_guard<std::mutex> lock(mu);
      ++counters.prefix_lookups;
      if (restored > 0) {
        ++counters.prefix_hits;
        counters.prefix_hit_tokens += restored;
      }
      copy_prefix_stats();
    }
    if (!spec.on()) {
      job.pending.assign(job.prompt.begin() + restored, job.prompt.end());
      return true;
    }
    try {
      spec.join(job, cache, restored);  // its rollback record may be refused memory too
    } catch (const std::exception& e) {
      cache.seq_rm(job.id);
      finish(job, "error", e.what());
      return false;
    }
    return true;
  }

  // Tokens `job` feeds this round when `prompt_rows` prompt rows are left
  // (a decoding row, or a prompt's last token, goes whole), and whether the
  // forward returns the logits of its last one: to sample, or for the
  // prefix-cache entry its piece ends at. Speculating, the pending tokens
  // are the prompt but its last, whose end needs no logits (that token
  // leads the next round's verify forward) unless an entry ends there.
  std::pair<std::int64_t, LogitRows> prefill_piece(const Job& job, std::int64_t prompt_rows, bool speculating) const {
    const auto want = static_cast<std::int64_t>(job.pending.size());
    std::int64_t take = want == 1 ? 1 : std::max<std::int64_t>(0, std::min(want, prompt_rows));
    if (!job.boundaries.empty()) take = std::min(take, job.boundaries.front() - job.in_cache);
    const bool at_boundary = take > 0 && !job.boundaries.empty() && job.in_cache + take == job.boundaries.front();
    const bool samples = take == want && !speculating;
    return {take, samples || at_boundary ? LogitRows::kLast : LogitRows::kNone};
  }

  // After a forward fed `take` tokens of `job`'s prompt (not its last):
  // stores the prefix-cache entry when the piece reached a boundary, with
  // the logits after it (`logits`). Never fails the request: a store that
  // fails is counted (and warned about once by the PrefixCache).
  void prefill_done(Job& job, std::int64_t take, const SequenceCache& cache, std::span<const float> logits) {
    job.pending.erase(job.pending.begin(), job.pending.begin() + take);
    job.in_cache += take;
    if (job.boundaries.empty() || job.in_cache != job.boundaries.front()) return;
    job.boundaries.pop_front();
    try {
      prefix->store(std::span<const std::int32_t>(job.prompt).first(static_cast<std::size_t>(job.in_cache)),
                    job.entry_from, cache.export_snapshot(job.id, job.entry_from), logits);
    } catch (const Error&) {
      // No memory for the entry's copy: it is not kept, the request goes on.
    }
    job.entry_from = job.in_cache;
    std::lock_guard<std::mutex> lock(mu);
    copy_prefix_stats();
  }

  // REQUIRES: mu held.
  void copy_prefix_stats() {
    const PrefixCacheStats& st = prefix->stats();
    counters.prefix_entries_written = st.entries_written;
    counters.prefix_store_errors = st.store_errors;
  }

  // Publishes `token` as the request's next; returns why the request ends
  // with it ("stop": an EOS, "length": max_tokens reached), or null.
  const char* emit(Job& job, std::int32_t token) {
    ++job.emitted;
    {
      // Counted before the client can see it: a reader of the counters
      // after a response has every one of its tokens.
      std::lock_guard<std::mutex> lock(mu);
      ++counters.generated_tokens;
    }
    publish(job, token);
    if (model.config().is_eos(token)) return "stop";
    return job.emitted >= job.max_tokens ? "length" : nullptr;
  }

  // A speculating request after its verify forward (`rows`: its logits):
  // emits the tokens the round keeps, up to an EOS or max_tokens; returns
  // why the request ends (as emit), or null.
  const char* emit_verified(Job& job, std::span<const float> rows, Speculation& spec, SequenceCache& cache) {
    std::int64_t kept = 0;
    const std::vector<std::int32_t> tokens = spec.accept(job, rows, cache, kept);
    {
      std::lock_guard<std::mutex> lock(mu);
      counters.accepted += kept;
    }
    for (const std::int32_t token : tokens) {
      job.sequence.push_back(token);
      if (const char* end = emit(job, token)) return end;  // the tokens after it are dropped
    }
    return nullptr;
  }

  // This round's forward: each request's share in `batch` and the tokens
  // of its pending it feeds in `fed`; returns the drafts it verifies. As
  // generate_batch: a decoding row goes whole, joining prompts share
  // max_prefill_rows and a prompt that does not fit goes on next round
  // (pieces end at prefix-cache boundaries: prefill_piece). A speculating
  // request's prompt but its last token goes first, then each round its
  // verify tokens with a row each.
  std::int64_t fill_batch(const std::vector<std::shared_ptr<Job>>& active, bool speculating,
                          std::vector<SequenceTokens>& batch, std::vector<std::int64_t>& fed) const {
    batch.clear();
    fed.clear();
    std::int64_t drafted = 0;
    std::int64_t prompt_rows = options.max_prefill_rows;
    for (const auto& job : active) {
      const auto want = static_cast<std::int64_t>(job->pending.size());
      if (job->prefilled) {
        drafted += static_cast<std::int64_t>(job->drafts.size());
        fed.push_back(want);
        batch.push_back({job->id, job->pending, LogitRows::kAll});
        continue;
      }
      const auto [take, rows] = prefill_piece(*job, prompt_rows, speculating);
      if (want > 1) prompt_rows -= take;
      fed.push_back(take);
      batch.push_back(
          {job->id, std::span<const std::int32_t>(job->pending).first(static_cast<std::size_t>(take)), rows});
    }
    return drafted;
  }

  // A finished, cancelled or failed request leaves: its blocks and states go
  // back at once, and its draft state.
  static void retire(Job& job, SequenceCache& cache, Speculation& spec) {
    cache.seq_rm(job.id);
    if (spec.on()) spec.leave(job);
  }

  // Moves the requests that fit in the batch beside `active` from the queue
  // to `joining` (waiting for one first); false once stop() was asked and
  // nothing is left to do.
  bool take_joining(const std::vector<std::shared_ptr<Job>>& active, std::vector<std::shared_ptr<Job>>& joining) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return !waiting.empty() || !active.empty() || quit; });
    if (waiting.empty() && active.empty()) return false;  // quit, and drained
    joining.clear();
    // A request whose client left while it waited leaves the queue at once,
    // wherever it is, so that it holds no place in the queue's limit.
    std::erase_if(waiting, [](const std::shared_ptr<Job>& job) {
      const bool cancelled = job->cancel.load();  // read once: a job erased is a job finished
      if (cancelled) finish(*job, "cancelled");
      return cancelled;
    });
    counters.waiting = static_cast<std::int64_t>(waiting.size());
    // A request takes a place per choice, the ones not forked yet included;
    // the queue's head waits until all of its places are free.
    std::int64_t places = 0;
    for (const auto& job : active) places += places_of(*job);
    while (!waiting.empty() && places + places_of(*waiting.front()) <= options.max_batch) {
      std::shared_ptr<Job> job = std::move(waiting.front());
      waiting.pop_front();
      // The gauge follows the queue at once, not at the round's end: a
      // reader (/metrics, a test waiting for a queued request) must not
      // count an admitted request as waiting.
      counters.waiting = static_cast<std::int64_t>(waiting.size());
      if (job->cancel) {  // cancelled since the sweep above
        finish(*job, "cancelled");
        continue;
      }
      counters.prompt_tokens += static_cast<std::int64_t>(job->prompt.size());
      places += places_of(*job);
      joining.push_back(std::move(job));
    }
    return true;
  }

  // After the round's forward (`logits`, the rows `batch` asked for): each
  // request of `active` takes its rows, prompt pieces move on (their
  // prefix-cache entries stored), decoding requests emit their tokens
  // (verified drafts included) and choices fork; returns the requests that
  // go on, the finished ones retired.
  std::vector<std::shared_ptr<Job>> after_forward(std::vector<std::shared_ptr<Job>>& active,
                                                  const std::vector<SequenceTokens>& batch,
                                                  const std::vector<std::int64_t>& fed,
                                                  const std::vector<float>& logits, SequenceCache& cache,
                                                  Speculation& spec) {
    const auto V = static_cast<std::size_t>(model.vocab_size());
    std::size_t row = 0;
    std::vector<std::shared_ptr<Job>> still;
    for (std::size_t k = 0; k < active.size(); ++k) {
      Job& job = *active[k];
      if (job.prefilled) {  // speculating: it verified its drafts
        const std::span<const float> rows(logits.data() + row * V, job.pending.size() * V);
        row += job.pending.size();
        if (const char* end = emit_verified(job, rows, spec, cache)) {
          retire(job, cache, spec);
          finish(job, end);
        } else {
          still.push_back(std::move(active[k]));
        }
        continue;
      }
      // A prompt piece has its last row's logits when it ends the prompt
      // or a prefix-cache interval (prefill_piece).
      std::span<const float> l;
      if (batch[k].logits == LogitRows::kLast) l = std::span<const float>(logits.data() + row++ * V, V);
      if (fed[k] < static_cast<std::int64_t>(job.pending.size())) {  // more of its prompt next round
        prefill_done(job, fed[k], cache, l);
        still.push_back(std::move(active[k]));
        continue;
      }
      if (spec.on()) {  // its prompt but the last token is in: it drafts and verifies from next round
        prefill_done(job, fed[k], cache, l);
        job.prefilled = true;
        std::vector<std::shared_ptr<Job>> forked = fork_speculating(job, cache, spec);
        still.push_back(std::move(active[k]));
        for (auto& fork : forked) still.push_back(std::move(fork));
        continue;
      }
      // Its prompt is in: the other choices fork from it before its own
      // token moves it on, and sample from the same logits.
      std::vector<std::shared_ptr<Job>> forked = fork_choices(job, cache);
      const auto sampled = [&](Job& j) {
        const std::int32_t token = sample(j, l);
        if (const char* end = emit(j, token)) {
          retire(j, cache, spec);
          finish(j, end);
          return false;
        }
        j.pending.assign(1, token);
        return true;
      };
      if (sampled(job)) still.push_back(std::move(active[k]));
      for (auto& fork : forked)
        if (sampled(*fork)) still.push_back(std::move(fork));
    }
    return still;
  }

  void decode_loop() {
    if (options.threads > 0) omp_set_num_threads(options.threads);
    SequenceCache cache = model.make_sequence_cache();
    Speculation spec(options, draft ? &*draft : nullptr, model);
    std::vector<std::shared_ptr<Job>> active;
    std::vector<std::shared_ptr<Job>> joining;
    std::vector<SequenceTokens> batch;
    std::vector<std::int64_t> fed;
    std::vector<float> logits;
    while (take_joining(active, joining)) {
      // Outside the lock: a lookup may wait for a store (Redis).
      for (std::shared_ptr<Job>& job : joining) {
        if (!admit(*job, cache, spec)) continue;
        // Speculating with its prompt but the last token restored (or a
        // one-token prompt): its choices fork now and draft this round.
        std::vector<std::shared_ptr<Job>> forked;
        if (job->prefilled) forked = fork_speculating(*job, cache, spec);
        active.push_back(std::move(job));
        for (auto& fork : forked) active.push_back(std::move(fork));
      }
      std::erase_if(active, [&](const std::shared_ptr<Job>& job) {
        if (!job->cancel) return false;
        retire(*job, cache, spec);
        finish(*job, "cancelled");
        return true;
      });
      if (active.empty()) {
        update_gauges(active.size(), cache);
        continue;
      }
      std::int64_t drafted = 0;
      try {
        if (spec.on()) spec.draft(active);
        drafted = fill_batch(active, spec.on(), batch, fed);
        model.forward_batch(batch, cache, logits);
        std::lock_guard<std::mutex> lock(mu);
        ++counters.forwards;
        counters.drafted += drafted;
        counters.peak_batch = std::max(counters.peak_batch, static_cast<std::int64_t>(batch.size()));
      } catch (const std::exception& e) {
        // All or nothing: no sequence moved (a draft model's sequences may
        // have, and go with their requests). Every request of the batch
        // fails (the budget or the system refused memory); the server goes on.
        for (const auto& job : active) {
          retire(*job, cache, spec);
          finish(*job, "error", e.what());
        }
        active.clear();
        update_gauges(0, cache);
        continue;
      }
      active = after_forward(active, batch, fed, logits, cache, spec);
      update_gauges(active.size(), cache);
    }
    update_gauges(0, cache);
  }

  // The places in the batch `job` takes: one, and one per choice not forked yet.
  static std::int64_t places_of(const Job& job) { return 1 + static_cast<std::int64_t>(job.forks.size()); }

  // The next token of `job` from its logits `l`, as generate() draws it.
  std::int32_t sample(Job& job, std::span<const float> l) const {
    if (job.sampling.greedy()) {
      return static_cast<std::int32_t>(runtime::kernels::argmax(l.data(), model.vocab_size()));
    }
    return runtime::sample_from(runtime::sampling_distribution(l, job.sampling), job.rng);
  }

  // Forks the choices `job` holds from its sequence, whose prompt is all in
  // the cache (speculating: all but the last token): O(layers + block runs)
  // each, the blocks shared copy-on-write. Returns them, seeded and ready to
  // sample (or verify) their first token; a choice the cache refuses
  // (memory) fails alone.
  std::vector<std::shared_ptr<Job>> fork_choices(Job& job, SequenceCache& cache) {
    std::vector<std::shared_ptr<Job>> forked;
    for (auto& fork : job.forks) {
      try {
        fork->id = cache.fork(job.id);
      } catch (const std::exception& e) {
        finish(*fork, "error", e.what());
        continue;
      }
      fork->rng.seed(fork->sampling.seed);
      forked.push_back(std::move(fork));
    }
    job.forks.clear();
    std::lock_guard<std::mutex> lock(mu);
    counters.forks += static_cast<std::int64_t>(forked.size());
    return forked;
  }

  // Speculating: forks the choices `job` holds once its prompt but the last
  // token is in (the last leads each one's first verify forward) and joins
  // each to the speculation (Speculation::join_fork).
  std::vector<std::shared_ptr<Job>> fork_speculating(Job& job, SequenceCache& cache, Speculation& spec) {
    std::vector<std::shared_ptr<Job>> forked = fork_choices(job, cache);
    for (auto& fork : forked) spec.join_fork(*fork, job);
    return forked;
  }

  void update_gauges(std::size_t running, const SequenceCache& cache) {
    std::lock_guard<std::mutex> lock(mu);
    counters.running = static_cast<std::int64_t>(running);
    counters.waiting = static_cast<std::int64_t>(waiting.size());
    counters.live_sequences = cache.num_sequences();
    const rwd::SequenceMemory m = cache.memory();
    counters.cache_bytes_used = m.bytes_used;
    counters.cache_bytes_reserved = m.bytes_reserved;
  }

  // Queues `job`; refuses with 503 while stopping and 429 past the queue limit.
  void submit(std::shared_ptr<Job> job) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (quit) {
        throw ApiError(503, "the server is shutting down; no new requests are taken", {}, "server_shutting_down",
                       "server_error");
      }
      if (static_cast<std::int64_t>(waiting.size()) >= options.queue_limit) {
        throw ApiError(
            429,
            "the server's queue is full (" + std::to_string(options.queue_limit) + " requests waiting); retry later",
            {}, "queue_full", "rate_limit_exceeded");
      }
      waiting.push_back(std::move(job));
      counters.waiting = static_cast<std::int64_t>(waiting.size());
    }
    cv.notify_all();
  }

  // ---- HTTP ----

  // One choice of a request as the client sees it: the decode loop's tokens
  // decoded to text, cut at a stop string, then (chat over a template with
  // the tags) split into reasoning, content and tool calls.
  struct Choice {
    std::shared_ptr<Job> job;
    runtime::StreamDecoder decoder;
    StopMatcher stop;
    std::optional<ChatOutputParser> parser;
    int tool_calls_sent = 0;  // streams: the index of the next tool call delta
    std::size_t seen = 0;
    std::int64_t completion_tokens = 0;
    std::string finish_reason;  // set when finished
    bool finished = false;
    bool reported = false;  // Completion::next returned its last event

    Choice(std::shared_ptr<Job> j, const Tokenizer& tokenizer, std::vector<std::string> stops)
        : job(std::move(j)), decoder(tokenizer, true), stop(std::move(stops)) {}

    // REQUIRES: job->channel->mu held.
    bool ready() const { return !finished && (job->tokens.size() > seen || job->done); }

    // The text that `fresh` tokens release (`done`: the job ended with them,
    // for `reason`); a stop string ends the choice and cancels its job.
    // Throws ApiError(500) when the decode loop failed it.
    std::string take(const std::vector<std::int32_t>& fresh, bool done, const std::string& reason,
                     const std::string& error) {
      std::string text;
      for (const std::int32_t t : fresh) {
        ++completion_tokens;
        text += stop.push(decoder.push(t));
        if (stop.stopped()) {
          job->cancel = true;  // the decode loop drops it next round
          finished = true;
          finish_reason = "stop";
          return text;
        }
      }
      if (done) {
        if (reason == "error") {
          throw ApiError(500, "generation failed: " + error, {}, "generation_failed", "server_error");
        }
        text += stop.push(decoder.finish());
        if (!stop.stopped()) text += stop.finish();
        finished = true;
        finish_reason = stop.stopped() ? "stop" : reason;
      }
      return text;
    }
  };

  // A request's generation as the client sees it: its choices (`n`), read
  // together as the decode loop publishes them.
  struct Completion {
    std::deque<Choice> choices;  // a deque: a Choice does not move
    std::shared_ptr<Channel> channel;
    std::int64_t prompt_tokens = 0;
    bool include_usage = false;
    bool chat = false;       // /v1/chat/completions: chat.completion(.chunk) objects
    bool sent_role = false;  // chat streams: the {"role": "assistant"} deltas went out
    bool failed = false;     // a stream ended with an error event
    std::string id;
    std::int64_t created = 0;

    // What next() has for a choice: its text so far (with a parser: its
    // content, reasoning and tool calls), and whether the choice ended with
    // it (finish_reason set).
    struct Event {
      std::size_t index;
      std::string text;
      bool last;
      std::string reasoning;
      std::vector<ToolCall> tool_calls;
    };
    std::mt19937_64 ids{std::random_device{}()};        // tool call ids
    std::chrono::steady_clock::time_point last_poll{};  // next(): when `gone` was last asked

    // A fresh tool call id: "call_" and 24 hexadecimal digits.
    std::string call_id() {
      char buf[32];
      std::snprintf(buf, sizeof buf, "call_%016llx%08llx", static_cast<unsigned long long>(ids()),
                    static_cast<unsigned long long>(ids() & 0xffffffffu));
      return buf;
    }

    bool all_reported() const {
      return std::all_of(choices.begin(), choices.end(), [](const Choice& c) { return c.reported; });
    }
    void cancel_all() {
      for (Choice& c : choices) c.job->cancel = true;
    }

    // REQUIRES: !all_reported(). Waits until a choice has news (tokens or
    // its end) and returns each such choice's event, in index order.
    // Throws ApiError(500) when the decode loop failed a choice, and
    // ClientGone when `gone` (asked every kClientPoll, waiting or not)
    // says the client left.
    std::vector<Event> next(const std::function<bool()>& gone = {}) {
      std::vector<Event> out;
      for (std::size_t i = 0; i < choices.size(); ++i) {
        if (choices[i].finished && !choices[i].reported) {  // max_tokens 0: ended before it began
          choices[i].reported = true;
          out.push_back(Event{i, std::string(), true, {}, {}});
        }
      }
      if (!out.empty()) return out;
      struct News {
        std::vector<std::int32_t> fresh;
        bool done = false;
        std::string reason, error;
      };
      std::vector<News> news(choices.size());
      const auto left = [&] {
        const auto now = std::chrono::steady_clock::now();
        if (!gone || now - last_poll < kClientPoll) return false;
        last_poll = now;
        return gone();
      };
      if (left()) throw ClientGone{};
      {
        std::unique_lock<std::mutex> lock(channel->mu);
        const auto any_ready = [&] {
          return std::any_of(choices.begin(), choices.end(), [](const Choice& c) { return c.ready(); });
        };
        while (!channel->cv.wait_for(lock, kClientPoll, any_ready)) {
          lock.unlock();  // the decode loop publishes under this lock; a poll need not hold it
          const bool away = left();
          lock.lock();
          if (away) throw ClientGone{};
        }
        for (std::size_t i = 0; i < choices.size(); ++i) {
          Choice& c = choices[i];
          if (!c.ready()) continue;
          news[i].fresh.assign(c.job->tokens.begin() + static_cast<std::ptrdiff_t>(c.seen), c.job->tokens.end());
          c.seen = c.job->tokens.size();
          news[i].done = c.job->done;
          news[i].reason = c.job->finish_reason;
          news[i].error = c.job->error;
        }
      }
      for (std::size_t i = 0; i < choices.size(); ++i) {
        Choice& c = choices[i];
        if (news[i].fresh.empty() && !news[i].done) continue;
        Event ev{i, c.take(news[i].fresh, news[i].done, news[i].reason, news[i].error), c.finished, {}, {}};
        if (c.parser) {
          ChatOutput parts = c.parser->push(ev.text);
          if (c.finished) {
            parts.append(c.parser->finish());
            // The model ended its turn (EOS) after calling tools.
            if (c.parser->had_tool_calls() && c.finish_reason == "stop" && !c.stop.stopped())
              c.finish_reason = "tool_calls";
          }
          ev.text = std::move(parts.content);
          ev.reasoning = std::move(parts.reasoning);
          ev.tool_calls = std::move(parts.tool_calls);
        }
        if (c.finished) c.reported = true;
        if (!ev.text.empty() || !ev.reasoning.empty() || !ev.tool_calls.empty() || c.finished)
          out.push_back(std::move(ev));
      }
      return out;
    }

    // The prompt once, the tokens of every choice.
    json usage() const {
      std::int64_t completion = 0;
      for (const Choice& c : choices) completion += c.completion_tokens;
      return {{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion},
              {"total_tokens", prompt_tokens + completion}};
    }
    // A streamed chunk of choice `index` (`last`: with its finish_reason;
    // `with_usage`: the request's usage); for chat, a chat.completion.chunk
    // whose delta is `delta`, or {"content": text}.
    json chunk(std::size_t index, const std::string& text, const std::string& model_name, bool last, bool with_usage,
               const json* delta = nullptr) const {
      const json reason = last ? json(choices[index].finish_reason) : json(nullptr);
      json j;
      if (chat) {
        json d = delta ? *delta : last && text.empty() ? json::object() : json{{"content", text}};
        j = {{"id", id},
             {"object", "chat.completion.chunk"},
             {"created", created},
             {"model", model_name},
             {"choices",
              json::array(
                  {{{"index", index}, {"delta", std::move(d)}, {"logprobs", nullptr}, {"finish_reason", reason}}})}};
      } else {
        j = {{"id", id},
             {"object", "text_completion"},
             {"created", created},
             {"model", model_name},
             {"choices",
              json::array({{{"text", text}, {"index", index}, {"logprobs", nullptr}, {"finish_reason", reason}}})}};
      }
      if (with_usage) j["usage"] = usage();
      return j;
    }
  };

  void completions(const httplib::Request& req, httplib::Response& res) {
    const json body = parse_body(req);
    check_model(body, name);
    respond(req, parse_completion(body, tokenizer, model.vocab_size(), context, options.max_batch), false, res);
  }

  // Waits for every choice of `c` and answers with one JSON object. A
  // client that leaves meanwhile (`client`) has its choices dropped within
  // a round, queued or running, and gets no answer.
  void answer_whole(Completion& c, const ClientConnection& client, httplib::Response& res) {
    std::vector<ChatOutput> parts(c.choices.size());
    try {
      while (!c.all_reported()) {
        for (Completion::Event& e : c.next([&] { return client.gone(); })) {
          parts[e.index].append({std::move(e.reasoning), std::move(e.text), std::move(e.tool_calls)});
        }
      }
    } catch (const ClientGone&) {
      c.cancel_all();
      {
        std::lock_guard<std::mutex> lock(mu);
        ++counters.cancelled;
      }
      // Nobody reads it: nginx's "client closed request", for httplib's logger.
      send_json(res, 499, ApiError(499, "the client closed the connection", {}, "client_closed").body());
      return;
    } catch (...) {
      c.cancel_all();
      throw;
    }
    json choices = json::array();
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const std::string& reason = c.choices[i].finish_reason;
      if (c.chat) {
        std::vector<std::string> ids;
        for (std::size_t k = 0; k < parts[i].tool_calls.size(); ++k) ids.push_back(c.call_id());
        choices.push_back({{"index", i},
                           {"message", chat_message_json(parts[i], ids)},
                           {"logprobs", nullptr},
                           {"finish_reason", reason}});
      } else {
        choices.push_back({{"text", parts[i].content}, {"index", i}, {"logprobs", nullptr}, {"finish_reason", reason}});
      }
    }
    send_json(res, 200,
              {{"id", c.id},
               {"object", c.chat ? "chat.completion" : "text_completion"},
               {"created", c.created},
               {"model", name},
               {"choices", std::move(choices)},
               {"usage", c.usage()}});
  }

  // One call of a stream's content provider: writes what `c`'s choices
  // have next (waiting for it), and at the end the usage chunk and [DONE].
  // Returns false when the client left.
  bool stream_step(Completion& c, httplib::DataSink& sink) const {
    const auto write = [&](const json& j) {
      const std::string line = "data: " + dump(j) + "\n\n";
      return sink.write(line.data(), line.size());
    };
    const auto end = [&] {
      const std::string done = "data: [DONE]\n\n";
      if (!sink.write(done.data(), done.size())) return false;
      sink.done();
      return true;
    };
    if (c.chat && !c.sent_role) {  // OpenAI's first chat chunk of each choice: the role alone
      c.sent_role = true;
      const json role = {{"role", "assistant"}, {"content", ""}};
      for (std::size_t i = 0; i < c.choices.size(); ++i)
        if (!write(c.chunk(i, "", name, false, false, &role))) return false;
      return true;
    }
    std::vector<Completion::Event> events;
    try {
      // A stream writes nothing while queued or prefilling: asking the
      // socket finds a client that left then (the end callback drops it).
      events = c.next([&] { return !sink.is_writable(); });
    } catch (const ClientGone&) {
      return false;
    } catch (const ApiError& e) {
      // Headers are out: the error goes as an event, then the end.
      c.cancel_all();
      c.failed = true;
      write(e.body());
      end();
      return true;
    }
    // The chunk that ends the request's last choice carries the usage.
    std::size_t usage_at = events.size();
    if (c.all_reported()) {
      for (std::size_t e = 0; e < events.size(); ++e)
        if (events[e].last) usage_at = e;
    }
    for (std::size_t e = 0; e < events.size(); ++e) {
      const Completion::Event& ev = events[e];
      if (c.chat) {
        // Reasoning, content, then each tool call whole, as one delta each.
        if (!ev.reasoning.empty()) {
          const json d = {{"reasoning_content", ev.reasoning}};
          if (!write(c.chunk(ev.index, "", name, false, false, &d))) return false;
        }
        if (!ev.text.empty() && !write(c.chunk(ev.index, ev.text, name, false, false))) return false;
        for (const ToolCall& call : ev.tool_calls) {
          const json d = {
              {"tool_calls", json::array({tool_call_json(call, c.call_id(), c.choices[ev.index].tool_calls_sent++)})}};
          if (!write(c.chunk(ev.index, "", name, false, false, &d))) return false;
        }
        if (ev.last && !write(c.chunk(ev.index, std::string(), name, true, e == usage_at))) return false;
        continue;
      }
      if (!ev.last) {
        if (!ev.text.empty() && !write(c.chunk(ev.index, ev.text, name, false, false))) return false;
        continue;
      }
      if (!write(c.chunk(ev.index, ev.text, name, true, e == usage_at))) return false;
    }
    if (!c.all_reported()) return true;
    if (c.include_usage) {
      json u = c.chunk(0, "", name, true, true);
      u["choices"] = json::array();
      if (!write(u)) return false;
    }
    return end();
  }

  // Runs a validated request and answers it: one JSON object, or a stream
  // of server-sent events. Choice i samples with the request's seed + i, as
  // runtime::generate_batch seeds its sequence i; the decode loop forks
  // choices 1..n-1 from choice 0 once the prompt is in (Job::forks).
  // `syntax`: what a chat turn's text is split by (ChatSyntax{}: nothing).
  void respond(const httplib::Request& req, const CompletionRequest& r, bool chat, httplib::Response& res,
               ChatSyntax syntax = {}) {
    auto c = std::make_shared<Completion>();
    c->channel = std::make_shared<Channel>();
    std::shared_ptr<Job> first;
    for (std::int64_t i = 0; i < r.n; ++i) {
      auto job = std::make_shared<Job>();
      job->channel = c->channel;
      job->max_tokens = r.max_tokens;
      job->sampling = r.sampling;
      job->sampling.seed = r.sampling.seed + static_cast<std::uint64_t>(i);
      if (i == 0) {
        job->prompt = r.prompt;
        first = job;
      } else {
        first->forks.push_back(job);
      }
      c->choices.emplace_back(std::move(job), tokenizer, r.stop);
      if (syntax.any()) c->choices.back().parser.emplace(syntax);
    }
    c->prompt_tokens = static_cast<std::int64_t>(r.prompt.size());
    c->include_usage = r.include_usage;
    c->chat = chat;
    c->id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id.fetch_add(1));
    c->created = static_cast<std::int64_t>(std::time(nullptr));
    if (r.max_tokens == 0) {
      for (Choice& choice : c->choices) {
        choice.finished = true;
        choice.finish_reason = "length";
      }
    } else {
      submit(first);
    }
    if (!r.stream) {
      const ClientConnection client(req.remote_addr, req.remote_port, req.local_addr, req.local_port);
      answer_whole(*c, client, res);
      return;
    }
    res.status = 200;
    res.set_header("Cache-Control", "no-cache");
    {
      std::lock_guard<std::mutex> lock(mu);
      ++open_streams;
    }
    res.set_chunked_content_provider(
        "text/event-stream", [this, c](std::size_t, httplib::DataSink& sink) { return stream_step(*c, sink); },
        [this, c](bool success) {
          // Always called when the response ends: a client that went away
          // mid-stream has its sequences dropped within a round.
          {
            std::lock_guard<std::mutex> lock(mu);
            if (!(c->all_reported() || c->failed) || !success) {
              c->cancel_all();
              ++counters.cancelled;
            }
            --open_streams;
          }
          streams_cv.notify_all();
        });
  }

  void chat_completions(const httplib::Request& req, httplib::Response& res) {
    const json body = parse_body(req);
    check_model(body, name);
    if (!chat_template) {
      throw ApiError(
          400,
          "this model has no chat template (" +
              (chat_template_problem.empty() ? "tokenizer_config.json beside the model names no chat_template"
                                             : chat_template_problem) +
              "); use /v1/completions with a prompt",
          "messages", "chat_template_unsupported");
    }
    CompletionRequest r;
    // OpenAI's default for chat is as many tokens as the context leaves.
    r.max_tokens = -1;
    parse_generation(body, context, options.max_batch, r);
    if (auto m = integer_field(body, "max_completion_tokens", 0, context)) r.max_tokens = *m;
    // The template sees the messages and tools as sent, keys in order
    // (tojson of a tool's schema keeps the client's order).
    const ordered_json ordered = ordered_json::parse(req.body);
    ordered_json vars = ordered_json::object();
    if (const auto kw = ordered.find("chat_template_kwargs"); kw != ordered.end() && !kw->is_null()) {
      if (!kw->is_object()) wrong_type("chat_template_kwargs", "an object", body["chat_template_kwargs"]);
      vars = *kw;  // vLLM's extension: e.g. {"enable_thinking": false}
    }
    vars["messages"] = chat_messages(ordered);
    if (const auto tools = ordered.find("tools"); tools != ordered.end() && !tools->is_null()) {
      if (!tools->is_array()) wrong_type("tools", "a list of tools", body["tools"]);
      if (!tools->empty()) vars["tools"] = *tools;
    }
    vars["add_generation_prompt"] = true;
    std::string text;
    try {
      text = chat_template->render(vars.dump(-1, ' ', false, ordered_json::error_handler_t::replace));
    } catch (const runtime::TemplateRaised& e) {
      throw ApiError(400, "the model's chat template refused the messages: " + e.message(), "messages",
                     "invalid_value");
    } catch (const runtime::TemplateError& e) {
      throw ApiError(400, std::string("the model's chat template cannot render these messages: ") + e.what(),
                     "messages", "invalid_value");
    }
    try {
      r.prompt = runtime::encode_rendered_chat(tokenizer, text);
    } catch (const InvalidArgument& e) {
      throw ApiError(400, std::string("the rendered chat cannot be tokenized: ") + e.what(), "messages",
                     "invalid_value");
    }
    if (r.prompt.empty()) {
      throw ApiError(400, "the chat template rendered these messages to no token", "messages", "invalid_value");
    }
    if (r.max_tokens < 0) {
      r.max_tokens = std::max<std::int64_t>(context - static_cast<std::int64_t>(r.prompt.size()), 0);
    }
    check_context(r, context);
    // Stop strings cut the model's text first; the parser splits what is left.
    ChatSyntax syntax = chat_syntax(chat_template->source(), text);
    if (const auto tools = body.find("tools"); tools != body.end())
      syntax.parameter_types = tool_parameter_types(*tools);
    respond(req, r, true, res, std::move(syntax));
  }

  std::string metrics() const {
    const ServerCounters c = snapshot();
    std::string out;
    const auto add = [&](const char* metric, const char* type, const char* help, std::int64_t v) {
      out += std::string("# HELP ") + metric + " " + help + "\n# TYPE " + metric + " " + type + "\n" + metric + " " +
             std::to_string(v) + "\n";
    };
    add("rewind_http_requests_total", "counter", "HTTP requests answered.", c.requests);
    add("rewind_completions_total", "counter", "Generation requests finished.", c.completions);
    add("rewind_cancelled_total", "counter",
        "Generation requests whose client went away before the end (queued, running or streaming).", c.cancelled);
    add("rewind_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", c.prompt_tokens);
    add("rewind_generated_tokens_total", "counter", "Tokens generated.", c.generated_tokens);
    add("rewind_forwards_total", "counter", "Batched forwards of the decode loop.", c.forwards);
    add("rewind_forks_total", "counter", "Choices forked from a request's prefilled prompt (n > 1).", c.forks);
    add("rewind_draft_tokens_total", "counter", "Draft tokens proposed for verification (speculation).", c.drafted);
    add("rewind_accepted_tokens_total", "counter", "Draft tokens the model accepted (speculation).", c.accepted);
    add("rewind_queue_waiting", "gauge", "Requests waiting for a place in the batch.", c.waiting);
    add("rewind_batch_running", "gauge", "Sequences in the running batch.", c.running);
    add("rewind_batch_peak", "gauge", "The most sequences one forward held.", c.peak_batch);
    add("rewind_cache_sequences", "gauge", "Sequences held by the decode loop's SequenceCache.", c.live_sequences);
    add("rewind_cache_bytes_used", "gauge", "Bytes the live sequences use in the SequenceCache.",
        static_cast<std::int64_t>(c.cache_bytes_used));
    add("rewind_cache_bytes_reserved", "gauge", "Bytes the SequenceCache holds, free blocks included.",
        static_cast<std::int64_t>(c.cache_bytes_reserved));
    add("rewind_prefix_lookups_total", "counter", "Admitted prompts looked up in the prefix cache.", c.prefix_lookups);
    add("rewind_prefix_hits_total", "counter", "Admitted requests that started from a stored prompt prefix.",
        c.prefix_hits);
    add("rewind_prefix_hit_tokens_total", "counter", "Prompt tokens restored from the prefix cache, not computed.",
        c.prefix_hit_tokens);
    add("rewind_prefix_entries_written_total", "counter", "Prefix-cache entries the store took.",
        c.prefix_entries_written);
    add("rewind_prefix_store_errors_total", "counter", "Prefix-store calls that failed (recomputed or not kept).",
        c.prefix_store_errors);
    return out;
  }

  ServerCounters snapshot() const {
    std::lock_guard<std::mutex> lock(mu);
    return counters;
  }

  // Runs `handler`, turning its ApiError (and anything else) into OpenAI-style error JSON.
  template <class Handler>
  httplib::Server::Handler guarded(Handler handler) {
    return [this, handler](const httplib::Request& req, httplib::Response& res) {
      try {
        (this->*handler)(req, res);
      } catch (const ApiError& e) {
        send_json(res, e.status(), e.body());
      } catch (const std::exception& e) {
        send_json(res, 500, ApiError(500, e.what(), {}, "internal_error", "server_error").body());
      }
    };
  }

  void routes() {
    http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      bool stopping = false;
      {
        std::lock_guard<std::mutex> lock(mu);
        stopping = quit;
      }
      send_json(res, stopping ? 503 : 200, {{"status", stopping ? "stopping" : "ok"}});
    });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      const json model_entry = {
          {"id", name}, {"object", "model"}, {"created", 0}, {"owned_by", "rewind"}, {"max_model_len", context}};
      send_json(res, 200, {{"object", "list"}, {"data", json::array({model_entry})}});
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics(), "text/plain; version=0.0.4");
    });
    http.Post("/v1/completions", guarded(&Impl::completions));
    http.Post("/v1/chat/completions", guarded(&Impl::chat_completions));
    // Statuses httplib sets itself (404 for an unknown path, 413 past the
    // body limit, 400 for a request it cannot parse) get an error body too.
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      std::string message, code;
      switch (res.status) {
        case 404:
          message = "no endpoint " + req.method + " " + req.path +
                    "; this server has GET /health, GET /v1/models, GET /metrics, POST /v1/completions, "
                    "POST /v1/chat/completions";
          code = "unknown_endpoint";
          break;
        case 413:
          message = "the request body is larger than this server accepts (--max-body-size)";
          code = "request_too_large";
          break;
        default: message = "the request was refused (HTTP " + std::to_string(res.status) + ")"; break;
      }
      send_json(res, res.status, ApiError(res.status, message, {}, code).body());
    });
    http.set_logger([this](const httplib::Request& req, const httplib::Response&) {
      std::lock_guard<std::mutex> lock(mu);
      ++counters.requests;
      if (req.path == "/v1/completions" && req.method == "POST") ++counters.completions;
    });
  }
};

namespace {

// The draft model of `dir` (ServerOptions::draft_dir), loaded as the target
// holds its weights. Its token ids must mean what the target's mean: the
// same vocabulary size, BOS and its use, EOS ids and tokenizer vocabulary.
Model load_draft(const std::string& dir, const Model& target, const Tokenizer& target_tokenizer,
                 runtime::LoadOptions::Pack pack) {
  runtime::LoadOptions load;
  load.weights = target.weight_format();
  load.pack = pack;  // the target's --no-pack holds for the draft too
  Model draft = Model::load(dir, load);
  if (!draft.pack_note().empty()) std::fprintf(stderr, "rewind serve: note: %s\n", draft.pack_note().c_str());
  const runtime::ModelConfig& t = target.config();
  const runtime::ModelConfig& d = draft.config();
  const auto describe = [](const runtime::ModelConfig& c) {
    std::string eos;
    for (const std::int64_t id : c.eos_token_ids) eos += (eos.empty() ? "" : ",") + std::to_string(id);
    return std::to_string(c.vocab_size) + " (BOS " + std::to_string(c.bos_token_id) + (c.add_bos ? "" : " not added") +
           ", EOS [" + eos + "])";
  };
  if (d.vocab_size != t.vocab_size || d.bos_token_id != t.bos_token_id || d.add_bos != t.add_bos ||
      d.eos_token_ids != t.eos_token_ids) {
    throw InvalidArgument("server option draft_dir: " + dir + " is incompatible with the model: vocabulary " +
                          describe(d) + " vs the model's " + describe(t));
  }
  const Tokenizer draft_tokenizer = runtime::tokenizer_for_model(dir, d);
  std::string why;
  if (!target_tokenizer.compatible_with(draft_tokenizer, &why)) {
    throw InvalidArgument(
        "server option draft_dir: " + dir +
        " is incompatible with the model: the tokenizers' vocabularies differ (the model's first): " + why);
  }
  return draft;
}

std::string default_name(const std::string& dir) {
  std::filesystem::path p(dir);
  while (!p.empty() && p.filename().empty()) p = p.parent_path();
  const std::string n = p.filename().string();
  return n.empty() ? dir : n;
}

}  // namespace

Server::Server(ServerOptions options) {
  const auto check = [](bool ok, const std::string& what) {
    if (!ok) throw InvalidArgument("server option " + what);
  };
  check(options.max_batch >= 1, "max_batch must be >= 1, got " + std::to_string(options.max_batch));
  check(options.http_threads >= 1, "http_threads must be >= 1, got " + std::to_string(options.http_threads));
  check(options.threads >= 0, "threads must be >= 0 (0: the OpenMP default), got " + std::to_string(options.threads));
  check(options.queue_limit >= 1, "queue_limit must be >= 1, got " + std::to_string(options.queue_limit));
  check(options.context >= 0, "context must be >= 0 (0: the model's), got " + std::to_string(options.context));
  check(options.max_prefill_rows >= 1,
        "max_prefill_rows must be >= 1, got " + std::to_string(options.max_prefill_rows));
  check(options.port >= 0 && options.port <= 65535, "port must be in [0, 65535], got " + std::to_string(options.port));
  check(options.max_body_bytes >= 1, "max_body_bytes must be >= 1");
  check(options.prefix_interval >= 1 && options.prefix_interval <= (std::int64_t{1} << 40),
        "prefix_interval must be in [1, 2^40], got " + std::to_string(options.prefix_interval));
  StoreSpecOptions spec;
  spec.capacity_bytes = options.prefix_cache_bytes;
  // Before the model loads: a bad URL is refused at once.
  if (options.prefix_reuse && !options.prefix_cache.empty()) check_store_spec(options.prefix_cache, spec);
  const std::string max_draft = std::to_string(runtime::kMaxDraft);
  check(options.num_draft >= 1 && options.num_draft <= runtime::kMaxDraft,
        "num_draft must be in [1, " + max_draft + "], got " + std::to_string(options.num_draft));
  check(options.lookup >= 0 && options.lookup <= runtime::kMaxDraft,
        "lookup must be in [1, " + max_draft + "] (0: off), got " + std::to_string(options.lookup));
  check(options.draft_dir.empty() || options.lookup == 0,
        "draft_dir (" + options.draft_dir + ") and lookup (" + std::to_string(options.lookup) +
            ") exclude each other: speculate with a draft model or with prompt lookup");
  Model model = Model::load(options.model_dir, options.load);
  // A stale pack file costs the start-up time it was written to save.
  if (!model.pack_note().empty()) std::fprintf(stderr, "rewind serve: note: %s\n", model.pack_note().c_str());
  Tokenizer tokenizer = runtime::tokenizer_for_model(options.model_dir, model.config());
  std::optional<Model> draft;
  if (!options.draft_dir.empty()) draft = load_draft(options.draft_dir, model, tokenizer, options.load.pack);
  const std::int64_t trained = model.config().max_position_embeddings;
  if (trained > 0 && options.context > trained) {
    throw InvalidArgument("server option context " + std::to_string(options.context) +
                          " is past the model's max_position_embeddings (" + std::to_string(trained) + ")");
  }
  const std::int64_t context = options.context > 0 ? options.context : trained > 0 ? trained : kDefaultContext;
  std::string name = options.model_name.empty() ? default_name(options.model_dir) : options.model_name;
  impl_ = std::make_unique<Impl>(std::move(options), std::move(model), std::move(tokenizer));
  impl_->draft = std::move(draft);
  impl_->context = context;
  impl_->name = std::move(name);
  if (impl_->options.prefix_reuse) {
    std::shared_ptr<BlobStore> store;
    if (impl_->options.prefix_cache.empty()) {
      store = make_memory_store(impl_->options.prefix_cache_bytes.value_or(kDefaultPrefixCacheBytes));
    } else {
      store = open_store_spec(impl_->options.prefix_cache, spec);  // null, after a warning, when unreachable
    }
    if (store) {
      impl_->prefix = std::make_unique<PrefixCache>(
          std::move(store), runtime::prefix_cache_options(impl_->model, impl_->options.prefix_interval));
    }
  }
  try {
    impl_->chat_template = runtime::ChatTemplate::from_model_dir(impl_->options.model_dir);
  } catch (const Error& e) {
    // Completions still work; the chat endpoint reports the problem.
    impl_->chat_template_problem = e.what();
    std::fprintf(stderr, "rewind serve: no chat template: %s\n", e.what());
  }
}

Server::~Server() { stop(); }

int Server::start() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.lifecycle);
  if (s.started || s.stopped) {
    throw StateError(std::string("Server::start: the server ") + (s.started ? "is already started" : "was stopped") +
                     " (a Server starts once; make a new one)");
  }
  const int threads = s.options.http_threads;
  s.http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<std::size_t>(threads)); };
  s.http.set_payload_max_length(s.options.max_body_bytes);
  s.http.set_tcp_nodelay(true);
  // SO_REUSEADDR alone: httplib's default adds SO_REUSEPORT, which would let
  // a second server bind the same port and silently share its connections.
  socket_t listening = INVALID_SOCKET;
  s.http.set_socket_options([&listening](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listening = sock;  // the last socket httplib tries is the one it binds
  });
  // Short idle keep-alive: stop() waits for idle connections to time out.
  s.http.set_keep_alive_timeout(2);
  s.routes();
  int port = s.options.port;
  if (port == 0) {
    port = s.http.bind_to_any_port(s.options.host);
    if (port < 0) port = 0;
  } else if (!s.http.bind_to_port(s.options.host, port)) {
    port = 0;
  }
  if (port <= 0) {
    throw InvalidArgument("cannot listen on " + s.options.host + ":" + std::to_string(s.options.port) +
                          " (address in use, not an address of this machine, or not allowed)");
  }
  // httplib 0.11 listens with a backlog of 5: a burst of clients connecting
  // at once overflowed it and some connections failed after the 1 s SYN
  // retry (seen with 32). listen() again on the bound socket raises it.
  int accepting = 0;
  socklen_t len = sizeof(accepting);
  if (listening != INVALID_SOCKET && getsockopt(listening, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len) == 0 &&
      accepting != 0) {
    ::listen(listening, SOMAXCONN);
  }
  s.bound_port = port;
  s.decoder = std::thread([&s] { s.decode_loop(); });
  s.listener = std::thread([&s] {
    s.http.listen_after_bind();
    s.listener_done = true;
  });
  // stop() must find the listener running, or httplib's stop() would miss it.
  while (!s.http.is_running() && !s.listener_done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  s.started = true;
  return port;
}

void Server::stop() {
  if (!impl_) return;
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.lifecycle);
  if (!s.started) return;
  {
    std::lock_guard<std::mutex> q(s.mu);
    s.quit = true;
  }
  s.cv.notify_all();
  s.decoder.join();  // every admitted request has its tokens
  {
    // httplib's stop() ends a stream at its next chunk, so the streams still
    // writing their (already generated) tokens finish first; a client that
    // stops reading fails its writes within httplib's write timeout, and one
    // reading too slowly is cut after kStreamDrainLimit.
    std::unique_lock<std::mutex> q(s.mu);
    s.streams_cv.wait_for(q, kStreamDrainLimit, [&] { return s.open_streams == 0; });
  }
  s.http.stop();  // the pool joins its threads
  s.listener.join();
  s.started = false;
  s.stopped = true;
}

int Server::port() const { return impl_->bound_port; }
const std::string& Server::model_name() const { return impl_->name; }
ServerCounters Server::counters() const { return impl_->snapshot(); }

}  // namespace rwd::server
