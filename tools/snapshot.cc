// rewind snapshot save / inspect / load: a sequence's whole state as a file
// (rewind/snapshot.h, docs/snapshot-format.md).
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "common.h"
#include "rewind/error.h"
#include "rewind/snapshot.h"
#include "runtime/model_config.h"

namespace rwd::cli {
namespace {

namespace fs = std::filesystem;

struct SnapshotFlags {
  std::string model_dir, out, file;
  PromptChoice prompt;
  std::int64_t max_new = 128;
  SamplingChoice sampling;
  bool stats = false;
  std::optional<std::int64_t> ctx_size;
};

// The bytes of snapshot file `path` (given as --file). Only a regular file
// is read, and only as many bytes as its size says: a device or a pipe
// (/dev/zero) has no end to read to, and the format's header does not give
// the total length. Throws InvalidArgument for a file that is not there or
// not regular, FormatError for an empty one.
std::vector<std::byte> read_file_bytes(const std::string& path) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (!ec && fs::exists(status) && !fs::is_regular_file(status) && !fs::is_directory(status)) {
    const char* kind = fs::is_character_file(status) ? "a character device"
                       : fs::is_block_file(status)   ? "a block device"
                       : fs::is_fifo(status)         ? "a pipe"
                       : fs::is_socket(status)       ? "a socket"
                                                     : "not a regular file";
    throw InvalidArgument("--file " + path + " is " + kind +
                          "; a snapshot is read from a regular file (written by "
                          "`rewind snapshot save`): copy the bytes to a file first");
  }
  std::ifstream in = open_input_file("--file", path);
  const std::uintmax_t size = fs::file_size(path, ec);
  if (ec) throw InvalidArgument("--file " + path + ": cannot read its size (" + ec.message() + ")");
  if (size == 0) {
    throw FormatError("--file " + path +
                      " is empty; a snapshot file starts with the 8 bytes \"RWNDSNAP\" and a "
                      "52-byte header (docs/snapshot-format.md)");
  }
  std::vector<std::byte> out(static_cast<std::size_t>(size));
  in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(out.size()));
  if (in.bad() || static_cast<std::uintmax_t>(in.gcount()) != size) {
    throw InvalidArgument("--file " + path + ": read error (read " + std::to_string(in.gcount()) + " of its " +
                          std::to_string(size) + " bytes; did it change while being read?)");
  }
  return out;
}

// Writes to a temporary name beside `path`, then renames: a reader never
// sees half a file.
void write_file_atomically(const std::string& path, const std::vector<std::byte>& bytes) {
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error("--out " + path + ": cannot write " + tmp);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      throw Error("--out " + path + ": writing " + tmp + " failed");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error("--out " + path + ": cannot rename " + tmp + " into place");
  }
}

int run_snapshot_save(const CLI::App& cmd, const std::string& model_dir, const PromptChoice& prompt_choice,
                      const std::string& out_path, const std::optional<std::int64_t>& ctx_size) {
  const std::string prompt = prompt_choice.read(cmd);
  const Model model = Model::load(model_dir);
  const std::vector<std::int32_t> tokens = encode_for_generation(load_tokenizer(model_dir, model), prompt,
                                                                 "the prompt");
  check_context(static_cast<std::int64_t>(tokens.size()), 0, resolve_ctx_size(ctx_size, model), ctx_size.has_value(),
                "the prompt");
  Cache cache = model.make_cache();
  std::vector<float> logits;
  GenerationStats stats;
  prefill(model, tokens, cache, logits, nullptr, stats, prompt_choice.max_prefill_rows);
  Snapshot snap = cache.snapshot();
  snap.tokens = tokens;
  snap.logits = Tensor(DType::F32, {static_cast<std::int64_t>(logits.size())});
  std::memcpy(snap.logits.data<float>(), logits.data(), logits.size() * sizeof(float));
  const std::vector<std::byte> bytes = serialize_snapshot(snap, model.fingerprint());
  write_file_atomically(out_path, bytes);
  std::printf("wrote %s: %lld tokens of %s, %zu bytes\n", out_path.c_str(), static_cast<long long>(snap.length),
              model.fingerprint().c_str(), bytes.size());
  return 0;
}

// The snapshot in file `path`, every field checked; FormatError names the file.
Snapshot read_snapshot_file(const std::string& path, const std::vector<std::byte>& bytes, std::string& fingerprint) {
  try {
    return deserialize_snapshot(bytes, &fingerprint);
  } catch (const FormatError& e) {
    throw FormatError(path + ": " + e.what());
  }
}

int run_snapshot_inspect(const std::string& path) {
  const std::vector<std::byte> bytes = read_file_bytes(path);
  std::string fingerprint;
  const Snapshot snap = read_snapshot_file(path, bytes, fingerprint);
  const SnapshotHeader header = read_snapshot_header(bytes);
  std::printf("%s: rewind snapshot, format version %u, %zu bytes, every checksum verified\n", path.c_str(),
              header.version, bytes.size());
  std::printf("model fingerprint: %s\n", fingerprint.c_str());
  std::printf("length: %lld tokens (%zu token ids stored), logits: %s\n", static_cast<long long>(snap.length),
              snap.tokens.size(), snap.logits.view().data ? snap.logits.view().describe().c_str() : "none");
  if (!snap.parent.empty()) std::printf("continues entry: %s\n", snap.parent.c_str());
  for (std::size_t i = 0; i < snap.layers.size(); ++i) {
    const LayerSnapshot& l = snap.layers[i];
    std::string parts;
    auto add = [&](const char* what, const Tensor& t) {
      parts += std::string(parts.empty() ? "" : ", ") + what + " " + t.view().describe();
    };
    if (l.keys.view().data || l.keys.view().rank > 0) {
      parts = "positions [" + std::to_string(l.first) + ", " + std::to_string(snap.length) + ")";
      add("keys", l.keys);
      add("values", l.values);
      for (const Tensor& t : l.sides) add("side", t);
    }
    for (const Tensor& t : l.conv_states) add("conv", t);
    for (const Tensor& t : l.recurrent_states) add("recurrent", t);
    auto bytes_of = [](const Tensor& t) { return t.view().data ? t.bytes() : std::size_t{0}; };
    std::size_t layer_bytes = bytes_of(l.keys) + bytes_of(l.values);
    for (const Tensor& t : l.sides) layer_bytes += bytes_of(t);
    for (const Tensor& t : l.conv_states) layer_bytes += bytes_of(t);
    for (const Tensor& t : l.recurrent_states) layer_bytes += bytes_of(t);
    const std::string kind(layer_kind_name(l.kind));
    std::printf("  layer %2zu  %-18s %10zu bytes  %s\n", i, kind.c_str(), layer_bytes,
                parts.empty() ? "(no state)" : parts.c_str());
  }
  return 0;
}

int run_snapshot_load(const CLI::App& cmd, const std::string& model_dir, const std::string& path, std::int64_t max_new,
                      const SamplingChoice& sampling_choice, bool stats_wanted,
                      const std::optional<std::int64_t>& ctx_size) {
  const SamplingParams sampling = sampling_choice.resolve(cmd);
  const std::vector<std::byte> bytes = read_file_bytes(path);
  std::string fingerprint;
  const Snapshot snap = read_snapshot_file(path, bytes, fingerprint);
  const Model model = Model::load(model_dir);
  if (fingerprint != model.fingerprint()) {
    throw InvalidArgument(path + " holds a state of model " + fingerprint + ", but " + model_dir + " is model " +
                          model.fingerprint() + " (other weights or config): it cannot continue it");
  }
  if (snap.logits.numel() != model.vocab_size() || snap.length < 1) {
    throw InvalidArgument(path + " holds no logits of its last token (or no token): `snapshot save` files do");
  }
  check_context(snap.length, max_new, resolve_ctx_size(ctx_size, model), ctx_size.has_value(),
                "the snapshot's sequence");
  Cache cache = model.make_cache();
  cache.restore(snap);
  std::vector<float> logits(snap.logits.data<float>(), snap.logits.data<float>() + model.vocab_size());
  const Tokenizer tokenizer = load_tokenizer(model_dir, model);
  GenerationOptions options;
  options.max_new_tokens = max_new;
  options.sampling = sampling;
  StdoutStream stream(tokenizer);
  options.on_token = [&stream](std::int32_t t) { stream.push(t); };
  GenerationStats stats;
  continue_generation(model, cache, logits, options, &stats);
  stream.finish();
  std::fputc('\n', stdout);
  if (stats_wanted) std::printf("%s\n", stats.to_json().c_str());
  return 0;
}

}  // namespace

Command add_snapshot_command(CLI::App& app, SharedFlags& shared) {
  auto flags = std::make_shared<SnapshotFlags>();
  SnapshotFlags& f = *flags;
  auto* snp = app.add_subcommand("snapshot", "save, inspect or load a sequence's whole state as a file");
  snp->require_subcommand(1);
  auto* snp_save = snp->add_subcommand("save",
                                       "prefill a prompt and write the state (with the logits of its last "
                                       "token) to a snapshot file");
  add_model_option(snp_save, f.model_dir);
  add_prompt_options(snp_save, f.prompt);
  snp_save->add_option("--out", f.out, "snapshot file to write (written whole, then renamed into place)")->required();
  add_threads_option(snp_save, shared.threads);
  add_ctx_option(snp_save, f.ctx_size);
  auto* snp_inspect = snp->add_subcommand("inspect", "validate a snapshot file (every checksum) and describe it");
  snp_inspect->add_option("--file", f.file, "snapshot file")->required();
  auto* snp_load = snp->add_subcommand("load",
                                       "restore a snapshot file and continue generating from it (same "
                                       "tokens as generating from its prompt)");
  snp_load->add_option("-m,--model", f.model_dir, "model directory (must be the snapshot's model)")
      ->required()
      ->check(CLI::ExistingDirectory);
  snp_load->add_option("--file", f.file, "snapshot file")->required();
  snp_load->add_option("-n,--max-new-tokens", f.max_new, "token budget")->check(integer_in(0, std::int64_t{1} << 30));
  add_sampling_options(snp_load, f.sampling);
  snp_load->add_flag("--stats", f.stats, "end with one JSON line of figures (as generate --stats)");
  add_threads_option(snp_load, shared.threads);
  add_ctx_option(snp_load, f.ctx_size);
  return {snp, [snp_save, snp_inspect, snp_load, flags] {
            const SnapshotFlags& o = *flags;
            if (*snp_save) return run_snapshot_save(*snp_save, o.model_dir, o.prompt, o.out, o.ctx_size);
            if (*snp_inspect) return run_snapshot_inspect(o.file);
            return run_snapshot_load(*snp_load, o.model_dir, o.file, o.max_new, o.sampling, o.stats, o.ctx_size);
          }};
}

}  // namespace rwd::cli
