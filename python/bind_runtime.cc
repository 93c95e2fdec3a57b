// The runtime binding: Model (loading, forward, generation) and its own
// rwd::Cache, ModelCache.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <omp.h>

#include "module.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/tokenizer.h"

namespace rwd::python {
namespace {

struct PyModel {
  rwd::runtime::Model model;
  // The directory's tokenizer.json, or the byte-level scheme without one.
  rwd::runtime::Tokenizer tokenizer;
};

struct PyModelCache {
  std::shared_ptr<PyModel> model;  // the cache's layers follow this model's shapes
  rwd::Cache cache;
  // Set while a forward runs without the GIL: every other use of the cache
  // (which holds the GIL throughout) is refused instead of racing with it.
  bool busy = false;
  rwd::Cache& use() {
    if (busy) throw rwd::StateError("this cache is in use by a forward running in another thread");
    return cache;
  }
};

std::string type_name_of(const py::handle& obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

// The token ids in `obj` (argument `what`; `accepted` lists what the caller
// takes): a list or tuple of ints, or a 1-D integer numpy array or torch
// tensor. Anything else is a TypeError naming what was given, before
// pybind11's cast could answer "Unable to cast Python instance".
std::vector<std::int64_t> token_list(const py::handle& obj, const std::string& what, const std::string& accepted) {
  auto refuse = [&](const std::string& given) {
    throw py::type_error(what + " must be " + accepted + "; got " + given);
  };
  if (py::isinstance<py::bytes>(obj) || PyByteArray_Check(obj.ptr())) {
    refuse(type_name_of(obj) + " (decode it to a str, or pass its token ids)");
  }
  if (py::isinstance<py::str>(obj)) refuse("str (text goes through Model.encode; this call takes token ids)");
  if (is_torch(obj) || py::hasattr(obj, "dtype")) {
    // A torch tensor or a numpy array: integer elements, one dimension.
    const std::string dtype = py::str(obj.attr("dtype"));
    const bool integer = is_torch(obj) ? !obj.attr("is_floating_point")().cast<bool>() &&
                                             !obj.attr("is_complex")().cast<bool>() && dtype != "torch.bool"
                                       : std::string(py::str(obj.attr("dtype").attr("kind"))).find_first_of("iu") == 0;
    if (!integer) refuse(type_name_of(obj) + " of dtype " + dtype);
    const auto ndim = obj.attr("ndim").cast<std::int64_t>();
    if (ndim != 1) refuse(type_name_of(obj) + " with " + std::to_string(ndim) + " dimensions (one is accepted)");
    return obj.attr("tolist")().cast<std::vector<std::int64_t>>();
  }
  if (!py::isinstance<py::list>(obj) && !py::isinstance<py::tuple>(obj)) refuse(type_name_of(obj));
  std::vector<std::int64_t> out;
  std::size_t i = 0;
  for (py::handle item : obj) {
    // Python ints and numpy integer scalars (both have __index__); a float does not.
    if (!PyIndex_Check(item.ptr()) || py::isinstance<py::float_>(item)) {
      refuse(type_name_of(obj) + " whose element " + std::to_string(i) + " is " + type_name_of(item) + " " +
             std::string(py::repr(item)));
    }
    py::int_ value = py::reinterpret_steal<py::int_>(PyNumber_Index(item.ptr()));
    if (!value) throw py::error_already_set();
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
    if (overflow != 0) invalid("token " + std::string(py::str(value)) + " is outside [0, 2^31)");
    out.push_back(v);
    ++i;
  }
  return out;
}

// What generate and generate_batch take as a prompt (Model.generate encodes a str first).
constexpr const char* kPromptAccepted =
    "a str (text) or a list of ints (token ids) / a 1-D integer numpy array or torch tensor";

// A model call's token ids: what token_list takes.
std::vector<std::int32_t> tokens_of(
    const py::handle& obj, const std::string& what = "tokens",
    const std::string& accepted = "a list of ints (token ids) or a 1-D integer numpy array / torch tensor") {
  std::vector<std::int64_t> wide = token_list(obj, what, accepted);
  std::vector<std::int32_t> out;
  out.reserve(wide.size());
  for (std::int64_t t : wide) {
    if (t < 0 || t > 0x7fffffff) invalid("token " + std::to_string(t) + " is outside [0, 2^31)");
    out.push_back(static_cast<std::int32_t>(t));
  }
  return out;
}

rwd::runtime::SamplingParams sampling_of(float temperature, std::int64_t top_k, float top_p, std::uint64_t seed) {
  rwd::runtime::SamplingParams s;
  s.temperature = temperature;
  s.top_k = top_k;
  s.top_p = top_p;
  s.seed = seed;
  rwd::runtime::validate(s);
  return s;
}

// A stats type's to_json() (the CLI's --stats line) as a dict: Python shows
// the CLI's keys and values.
template <typename Stats>
py::object stats_dict(const Stats& s) {
  return py::module_::import("json").attr("loads")(s.to_json());
}

// Logits [n, vocab] (or [vocab]) as a numpy array that owns its memory.
py::array_t<float> logits_array(std::vector<float>&& logits, std::int64_t n, std::int64_t vocab, bool all_logits) {
  auto* owned = new std::vector<float>(std::move(logits));
  py::capsule base(owned, [](void* p) { delete static_cast<std::vector<float>*>(p); });
  if (all_logits) {
    return py::array_t<float>(
        {n, vocab}, {vocab * static_cast<std::int64_t>(sizeof(float)), static_cast<std::int64_t>(sizeof(float))},
        owned->data(), base);
  }
  return py::array_t<float>({vocab}, {static_cast<std::int64_t>(sizeof(float))}, owned->data(), base);
}

// Model.generate: plain or speculative decoding of one prompt; (new tokens, stats).
py::tuple generate_one(const PyModel& self, py::object prompt, std::int64_t max_new_tokens, float temperature,
                       std::int64_t top_k, float top_p, std::uint64_t seed, bool stop_at_eos,
                       std::shared_ptr<PyModel> draft, std::int64_t num_draft, std::int64_t lookup, bool adaptive,
                       std::int64_t max_prefill_rows) {
  auto p = tokens_of(prompt, "generate: the prompt", kPromptAccepted);
  if (p.empty()) invalid("generate: the prompt is empty");
  rwd::runtime::GenerationOptions o;
  o.max_new_tokens = max_new_tokens;
  o.max_prefill_rows = max_prefill_rows;
  o.stop_at_eos = stop_at_eos;
  o.sampling = sampling_of(temperature, top_k, top_p, seed);
  if (draft && lookup > 0) invalid("generate: give a draft model or prompt lookup, not both");
  rwd::runtime::GenerationStats stats;
  std::vector<std::int32_t> out;
  if (!draft && lookup == 0) {
    py::gil_scoped_release nogil;
    out = rwd::runtime::generate(self.model, p, o, &stats);
  } else {
    rwd::runtime::check_num_draft(num_draft, "num_draft");
    if (lookup < 0) invalid("generate: lookup must be >= 0");
    rwd::runtime::SpeculativeOptions spec;
    spec.num_draft = num_draft;
    spec.adaptive = adaptive;
    o.speculation = spec;
    py::gil_scoped_release nogil;
    if (draft) {
      if (draft->model.vocab_size() != self.model.vocab_size()) {
        throw rwd::InvalidArgument("generate: the draft's vocabulary (" + std::to_string(draft->model.vocab_size()) +
                                   ") differs from the target's (" + std::to_string(self.model.vocab_size()) + ")");
      }
      rwd::runtime::SamplingParams ds = o.sampling;
      rwd::runtime::ModelDraft source(draft->model, ds, num_draft, max_prefill_rows);
      out = rwd::runtime::speculative_generate(self.model, source, p, o, &stats);
    } else {
      rwd::runtime::LookupDraft source(lookup);
      out = rwd::runtime::speculative_generate(self.model, source, p, o, &stats);
    }
  }
  return py::make_tuple(out, stats_dict(stats));
}

// Model.generate_batch: many prompts in one SequenceCache; (new tokens per prompt, stats).
py::tuple generate_many(const PyModel& self, py::object prompts, std::int64_t max_new_tokens, float temperature,
                        std::int64_t top_k, float top_p, std::uint64_t seed, bool stop_at_eos,
                        std::shared_ptr<PyModel> draft, std::int64_t num_draft, std::int64_t lookup, bool adaptive,
                        std::int64_t max_batch, std::int64_t max_prefill_rows) {
  std::vector<std::vector<std::int32_t>> ps;
  if (py::isinstance<py::str>(prompts) || py::isinstance<py::bytes>(prompts)) {
    throw py::type_error("generate_batch: prompts must be a list of prompts (each " + std::string(kPromptAccepted) +
                         "); got " + type_name_of(prompts));
  }
  std::size_t index = 0;
  for (py::handle p : prompts) {
    ps.push_back(tokens_of(p, "generate_batch: prompt " + std::to_string(index++), kPromptAccepted));
  }
  rwd::runtime::GenerationOptions o;
  o.max_new_tokens = max_new_tokens;
  o.max_prefill_rows = max_prefill_rows;
  o.stop_at_eos = stop_at_eos;
  o.sampling = sampling_of(temperature, top_k, top_p, seed);
  if (max_batch < 0) invalid("generate_batch: max_batch must be >= 0");
  o.max_batch = max_batch;
  if (draft && lookup > 0) invalid("generate_batch: give a draft model or prompt lookup, not both");
  if (lookup < 0) invalid("generate_batch: lookup must be >= 0");
  rwd::runtime::GenerationStats stats;
  std::vector<std::vector<std::int32_t>> out;
  if (!draft && lookup == 0) {
    py::gil_scoped_release nogil;
    out = rwd::runtime::generate_batch(self.model, ps, o, &stats);
  } else {
    rwd::runtime::check_num_draft(num_draft, "num_draft");
    if (draft && draft->model.vocab_size() != self.model.vocab_size()) {
      invalid("generate_batch: the draft's vocabulary (" + std::to_string(draft->model.vocab_size()) +
              ") differs from the target's (" + std::to_string(self.model.vocab_size()) + ")");
    }
    rwd::runtime::SpeculativeOptions spec;
    spec.num_draft = num_draft;
    spec.adaptive = adaptive;
    o.speculation = spec;
    py::gil_scoped_release nogil;
    std::unique_ptr<rwd::runtime::BatchDraftSource> sources;
    if (draft) {
      sources = std::make_unique<rwd::runtime::BatchedModelDraft>(draft->model, o.sampling, num_draft,
                                                                  max_prefill_rows);
    } else {
      std::vector<std::unique_ptr<rwd::runtime::DraftSource>> each;
      for (std::size_t i = 0; i < ps.size(); ++i) each.push_back(std::make_unique<rwd::runtime::LookupDraft>(lookup));
      sources = std::make_unique<rwd::runtime::PerSequenceDrafts>(std::move(each));
    }
    out = rwd::runtime::speculative_generate_batch(self.model, *sources, ps, o, &stats);
  }
  return py::make_tuple(out, stats_dict(stats));
}

void bind_model_cache(py::module_& m) {
  py::class_<PyModelCache, std::shared_ptr<PyModelCache>>(
      m, "ModelCache", "A model's own rewind cache (rwd::Cache with the model's layer shapes), for Model.forward.")
      .def(
          "get_seq_length", [](PyModelCache& c) { return c.use().get_seq_length(); }, "Tokens in the cache.")
      .def(
          "crop", [](PyModelCache& c, std::int64_t n) { c.use().crop(n); }, py::arg("n"),
          "Transactional crop of every layer (negative: remove that many tokens).")
      .def(
          "check_crop", [](PyModelCache& c, std::int64_t n) { c.use().check_crop(n); }, py::arg("n"),
          "Raises what crop(n) would raise; changes nothing.")
      .def(
          "max_rollback", [](PyModelCache& c) { return c.use().max_rollback(); },
          "Largest k for which crop(-k) is exact now.")
      .def(
          "activate_past_recording", [](PyModelCache& c, std::int64_t r) { c.use().activate_past_recording(r); },
          py::arg("max_tokens"), "Keeps enough history in every layer to remove up to max_tokens tokens exactly.")
      .def(
          "reset", [](PyModelCache& c) { c.use().reset(); }, "Back to empty; recording stays.")
      .def(
          "memory",
          [](PyModelCache& c) {
            auto mem = c.use().memory();
            py::dict d;
            d["bytes_reserved"] = mem.bytes_reserved;
            d["bytes_used"] = mem.bytes_used;
            return d;
          },
          "Bytes reserved and used by the cache.")
      .def(
          "set_memory_budget", [](PyModelCache& c, std::size_t b) { c.use().set_memory_budget(b); }, py::arg("bytes"),
          "Caps the bytes the cache may reserve (0: no cap); an operation that would pass it raises CapacityError "
          "and changes nothing.");
}

// Model.load: the weights and the tokenizer read without the GIL.
std::shared_ptr<PyModel> load_model(const std::string& dir, const std::optional<std::string>& weights, bool pack) {
  rwd::runtime::LoadOptions options;
  if (weights) options.weights = rwd::runtime::weight_format_from_name(*weights, "Model.load: weights");
  options.pack = pack ? rwd::runtime::LoadOptions::Pack::kIfCurrent : rwd::runtime::LoadOptions::Pack::kNever;
  std::shared_ptr<PyModel> loaded;
  {
    py::gil_scoped_release nogil;
    rwd::runtime::Model model = rwd::runtime::Model::load(dir, options);
    rwd::runtime::Tokenizer tokenizer = rwd::runtime::tokenizer_for_model(dir, model.config());
    loaded = std::make_shared<PyModel>(PyModel{std::move(model), std::move(tokenizer)});
  }
  return loaded;
}

// Model.forward: the cache is marked busy while the GIL is released, so
// another thread cannot use it meanwhile.
py::array_t<float> forward_tokens(const PyModel& self, py::object tokens, PyModelCache& cache, bool all_logits) {
  if (cache.model.get() != &self) invalid("forward: the cache was made by another model");
  auto t = tokens_of(tokens, "forward: tokens");
  std::vector<float> logits;
  rwd::Cache& c = cache.use();
  cache.busy = true;
  try {
    py::gil_scoped_release nogil;
    self.model.forward(t, c, logits, all_logits);
  } catch (...) {
    cache.busy = false;
    throw;
  }
  cache.busy = false;
  return logits_array(std::move(logits), static_cast<std::int64_t>(t.size()), self.model.vocab_size(), all_logits);
}

void bind_model(py::module_& m) {
  py::class_<PyModel, std::shared_ptr<PyModel>>(m, "Model", "The reference runtime's hybrid decoder (runtime/model.h).")
      .def_static("load", &load_model, py::arg("directory"), py::arg("weights") = py::none(), py::arg("pack") = true,
                  "Loads DIR/config.json, DIR/model.safetensors (or its shards) and DIR/tokenizer.json when present; "
                  "weights='q8' quantizes the linear weights at load, a Q8 checkpoint (rewind quantize) loads as q8 by "
                  "itself and refuses weights='as-stored' (docs/quantization.md). A current pack file of those "
                  "weights in DIR (rewind pack) is mapped instead of packing unless pack=False "
                  "(docs/model-format.md); pack_path and pack_note say what happened.")
      .def_property_readonly(
          "pack_path", [](const PyModel& self) { return self.model.pack_path(); },
          "The pack file the matrices are mapped from, or '' (packed at load).")
      .def_property_readonly(
          "pack_note", [](const PyModel& self) { return self.model.pack_note(); },
          "Why a pack file in the directory was not used, or ''.")
      .def_property_readonly(
          "weights",
          [](const PyModel& self) { return std::string(rwd::runtime::weight_format_name(self.model.weight_format())); })
      .def_property_readonly("vocab_size", [](const PyModel& self) { return self.model.vocab_size(); })
      .def_property_readonly("parameter_count", [](const PyModel& self) { return self.model.parameter_count(); })
      .def_property_readonly("layer_types",
                             [](const PyModel& self) {
                               std::vector<std::string> names;
                               for (rwd::LayerKind k : self.model.config().layer_types)
                                 names.emplace_back(rwd::layer_kind_name(k));
                               return names;
                             })
      .def(
          "make_cache",
          [](std::shared_ptr<PyModel> self) {
            return std::make_shared<PyModelCache>(PyModelCache{self, self->model.make_cache()});
          },
          "An empty cache for one sequence.")
      .def_property_readonly("tokenizer", [](const PyModel& self) { return self.tokenizer.describe(); })
      .def(
          "encode", [](const PyModel& self, const std::string& text) { return self.tokenizer.encode(text, true); },
          py::arg("text"),
          "The text's tokens with the model's tokenizer, BOS / template tokens first (byte-level: BOS + bytes).")
      .def(
          "decode",
          [](const PyModel& self, py::object tokens) {
            auto t = tokens_of(tokens, "decode: tokens");
            return py::bytes(self.tokenizer.decode(t, true));
          },
          py::arg("tokens"), "The bytes of the tokens with the model's tokenizer (special tokens skipped).")
      .def("forward", &forward_tokens, py::arg("tokens"), py::arg("cache"), py::arg("all_logits") = true,
           "Runs tokens at positions [L, L+n), appends them to `cache`, returns float32 logits [n, vocab] "
           "(or [vocab] for the last token when all_logits is False).")
      .def("generate", &generate_one, py::arg("prompt"), py::arg("max_new_tokens") = 128, py::arg("temperature") = 0.0f,
           py::arg("top_k") = 0, py::arg("top_p") = 1.0f, py::arg("seed") = 0, py::arg("stop_at_eos") = true,
           py::arg("draft") = nullptr, py::arg("num_draft") = 4, py::arg("lookup") = 0, py::arg("adaptive") = false,
           py::arg("max_prefill_rows") = rwd::runtime::kDefaultMaxPrefillRows,
           "Greedy (temperature 0) or sampled generation; speculative with `draft` (a Model) or prompt lookup "
           "(`lookup` = max n-gram). A prompt goes in forwards of at most `max_prefill_rows` tokens (the same "
           "output; bounded memory). Returns (new_tokens, stats).")
      .def("generate_batch", &generate_many, py::arg("prompts"), py::arg("max_new_tokens") = 128,
           py::arg("temperature") = 0.0f, py::arg("top_k") = 0, py::arg("top_p") = 1.0f, py::arg("seed") = 0,
           py::arg("stop_at_eos") = true, py::arg("draft") = nullptr, py::arg("num_draft") = 4, py::arg("lookup") = 0,
           py::arg("adaptive") = false, py::arg("max_batch") = 0,
           py::arg("max_prefill_rows") = rwd::runtime::kDefaultMaxPrefillRows,
           "Batched generation of many prompts in one SequenceCache (the CLI's --prompts / --max-batch); sequence i "
           "samples with seed + i; joining prompts share at most `max_prefill_rows` prompt tokens a forward. "
           "Returns (list of new tokens per prompt, stats).");
}

}  // namespace

void bind_runtime(py::module_& m) {
  bind_model_cache(m);
  bind_model(m);
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 1 || n > 1024) invalid("set_num_threads: n must be in [1, 1024], got " + std::to_string(n));
        omp_set_num_threads(n);
      },
      py::arg("n"),
      "OpenMP threads of the runtime's forwards (the CLI's --threads). The process shares OpenMP "
      "with torch, so this also sets torch's intra-op OpenMP threads.");
  m.def("get_num_threads", [] { return omp_get_max_threads(); });
}

}  // namespace rwd::python
