// rewind inspect: layers, parameters and memory of a model.
#include <cstdio>
#include <fstream>
#include <map>

#include "common.h"
#include "rewind/error.h"
#include "runtime/model_config.h"

namespace rwd::cli {
namespace {

struct InspectFlags {
  std::string model_dir;
  std::int64_t rollback = 8;
};

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (b >= 1024.0 && u < 6) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
  return buf;
}

// "family: ... ; layers: ...": the family, how many layers of each kind
// and the variants of the architecture the config turns on.
void print_family(const ModelConfig& c) {
  std::map<std::string, int> mix;
  for (const LayerKind kind : c.layer_types) ++mix[std::string(layer_kind_name(kind))];
  std::string mix_text;
  for (const auto& [kind, count] : mix) mix_text += (mix_text.empty() ? "" : ", ") + std::to_string(count) + " " + kind;
  std::string variants;
  auto add = [&variants](bool on, const std::string& what) {
    if (on) variants += (variants.empty() ? "" : ", ") + what;
  };
  add(c.norm_plus_one, "(1 + w) RMSNorm");
  add(c.qk_norm, "q/k norm");
  add(c.attn_output_gate, "attention output gate");
  add(c.rope_dim() != c.head_dim, "partial RoPE " + std::to_string(c.rope_dim()) + "/" + std::to_string(c.head_dim));
  {
    const ModelConfig::Llama3Rope& r = c.llama3_rope;
    char scaling[160];
    std::snprintf(scaling, sizeof scaling,
                  "llama3 RoPE scaling (factor %g, low_freq_factor %g, high_freq_factor %g, original context %lld)",
                  r.factor, r.low_freq_factor, r.high_freq_factor, static_cast<long long>(r.original_max_positions));
    add(r.factor > 0.0, scaling);
  }
  add(c.fused_gdn_projections, "fused in_proj_qkvz / in_proj_ba");
  add(c.tie_word_embeddings, "tied embeddings");
  std::printf("family: %s (model_type %s); layers: %s%s%s\n", model_family_name(c.family), c.model_type.c_str(),
              mix_text.c_str(), variants.empty() ? "" : "; ", variants.c_str());
}

// The shape of layer `layer`, of kind `kind`, for its line of the layer list.
std::string layer_detail(const ModelConfig& c, LayerKind kind, std::int64_t layer) {
  std::string detail;
  switch (runtime_layer_kind(kind, layer)) {
    case RuntimeLayerKind::FullAttention:
    case RuntimeLayerKind::SlidingAttention:
      detail = std::to_string(c.num_attention_heads) + " heads / " + std::to_string(c.num_key_value_heads) +
               " kv heads x " + std::to_string(c.head_dim);
      if (kind == LayerKind::SlidingAttention) detail += ", window " + std::to_string(c.sliding_window);
      break;
    case RuntimeLayerKind::LinearAttention:
      detail = "Gated DeltaNet, conv " + std::to_string(c.linear_conv_dim()) +
               " x K=" + std::to_string(c.linear_conv_kernel_dim) + ", state [" +
               std::to_string(c.linear_num_value_heads) + ", " + std::to_string(c.linear_key_head_dim) + ", " +
               std::to_string(c.linear_value_head_dim) + "]";
      break;
    case RuntimeLayerKind::Conv:
      detail = "short conv, " + std::to_string(c.hidden_size) + " channels x K=" + std::to_string(c.conv_L_cache);
      break;
  }
  return detail;
}

// VmHWM: the peak resident memory of this process so far, i.e. what loading
// the model cost on top of the CLI itself.
std::string peak_resident_memory() {
  std::ifstream status("/proc/self/status");
  std::string line, peak = "unknown";
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) peak = line.substr(6);
  }
  peak.erase(0, peak.find_first_not_of(" \t"));
  return peak;
}

int run_inspect(const std::string& model_dir, std::int64_t rollback) {
  const Model model = Model::load(model_dir);
  const ModelConfig& c = model.config();
  // The library refuses R above 2^40 and figures above 2^48 bytes (rather
  // than wrap around); either is a bad --rollback here.
  std::size_t rollback_total = 0;
  try {
    rollback_total = model.rollback_bytes(rollback);
  } catch (const rwd::Error& e) {
    throw InvalidArgument("--rollback " + std::to_string(rollback) + ": " + e.what());
  }
  // A Q8 checkpoint (rewind quantize) loads as q8 by itself: say so, and
  // what its other tensors are.
  const bool q8 = model.weight_format() == WeightFormat::kQ8;
  const std::string stored = q8 ? "q8 (a Q8 checkpoint: int8 blocks of 32 with a bf16 scale each; the other tensors " +
                                      std::string(dtype_name(c.torch_dtype)) + ")"
                                : std::string(dtype_name(c.torch_dtype));
  std::printf("model %s: %s, %lld layers, hidden %lld, vocab %lld, weights stored as %s\n", model_dir.c_str(),
              c.model_type.c_str(), static_cast<long long>(c.num_hidden_layers), static_cast<long long>(c.hidden_size),
              static_cast<long long>(c.vocab_size), stored.c_str());
  std::printf("tokenizer: %s\n", load_tokenizer(model_dir, model).describe().c_str());
  std::printf("parameters: %lld\n", static_cast<long long>(model.parameter_count()));
  print_family(c);
  for (std::size_t i = 0; i < c.layer_types.size(); ++i) {
    const LayerKind kind = c.layer_types[i];
    const std::string detail = layer_detail(c, kind, static_cast<std::int64_t>(i));
    const std::string t(layer_kind_name(kind));
    std::printf("  layer %2zu  %-18s %s\n", i, t.c_str(), detail.c_str());
  }
  const std::string peak = peak_resident_memory();
  std::printf("weights in memory: %s (%s); peak resident memory of this process: %s\n",
              human_bytes(static_cast<double>(model.weight_bytes())).c_str(),
              q8 ? "matmul weights as q8" : "in the stored dtype", peak.c_str());
  if (!model.pack_path().empty()) {
    std::printf("matrices: mapped from pack file %s\n", model.pack_path().c_str());
  } else if (!model.pack_note().empty()) {
    std::printf("matrices: packed at load; %s\n", model.pack_note().c_str());
  } else {
    std::printf("matrices: packed at load (no pack file; rewind pack writes one)\n");
  }
  std::printf("KV bytes per token (full-attention layers, f32): %s\n",
              human_bytes(static_cast<double>(model.kv_bytes_per_token())).c_str());
  std::printf("fixed state bytes per sequence (sliding windows + conv + recurrent states): %s\n",
              human_bytes(static_cast<double>(model.fixed_state_bytes())).c_str());
  std::printf("rollback memory for R = %lld: at most %s more\n", static_cast<long long>(rollback),
              human_bytes(static_cast<double>(rollback_total)).c_str());
  return 0;
}

}  // namespace

Command add_inspect_command(CLI::App& app, SharedFlags&) {
  auto flags = std::make_shared<InspectFlags>();
  InspectFlags& f = *flags;
  auto* ins = app.add_subcommand("inspect", "describe a model's layers and memory");
  add_model_option(ins, f.model_dir);
  ins->add_option("--rollback", f.rollback, "R for the rollback-memory figure")
      ->check(integer_in(0, std::numeric_limits<std::int64_t>::max()));
  return {ins, [flags] { return run_inspect(flags->model_dir, flags->rollback); }};
}

}  // namespace rwd::cli
