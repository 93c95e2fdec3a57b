// What the server tests share: the names they use, where the shipped model
// is, a copy of it with a chat template, and the server-sent events of a
// streamed body.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/tokenizer.h"
#include "server/server.h"

namespace rwt::server {

using json = nlohmann::json;
using rwd::runtime::GenerationOptions;
using rwd::runtime::Model;
using rwd::runtime::Tokenizer;
using rwd::server::Server;
using rwd::server::ServerCounters;
using rwd::server::ServerOptions;

// The shipped hybrid model (byte level, BOS 256) the server tests run.
inline std::string model_dir() { return std::string(REWIND_SOURCE_DIR) + "/models/kjv-hybrid"; }

// Makes `dir` the shipped model again (config.json copied, the weights
// linked) beside a tokenizer_config.json holding `chat_template`.
inline void make_chat_model(const std::filesystem::path& dir, const std::string& chat_template) {
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(model_dir() + "/config.json", dir / "config.json",
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::remove(dir / "model.safetensors");
  std::filesystem::create_symlink(model_dir() + "/model.safetensors", dir / "model.safetensors");
  std::ofstream(dir / "tokenizer_config.json") << json{{"chat_template", chat_template}}.dump();
}

// The model of `dir` and its tokenizer, as a suite's reference decoding
// holds them from SetUpTestSuite to unload_model (which deletes them).
inline void load_model(const std::string& dir, Model*& model, Tokenizer*& tokenizer) {
  model = new Model(Model::load(dir));
  tokenizer = new Tokenizer(rwd::runtime::tokenizer_for_model(dir, model->config()));
}
inline void unload_model(Model* model, Tokenizer* tokenizer) {
  delete tokenizer;
  delete model;
}

// A suite's server, started with `options`; returns its port.
inline int start_server(const ServerOptions& options, Server*& server) {
  server = new Server(options);
  return server->start();
}

// A POST of `body` to /v1/completions, for a test that reads the response
// as it comes (its content_receiver).
inline httplib::Request completion_request(const json& body) {
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.set_header("Content-Type", "application/json");
  req.body = body.dump();
  return req;
}

// The data lines of an SSE body, without "data: ", each checked to be one.
inline std::vector<std::string> sse_data(const std::string& body) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at < body.size()) {
    const std::size_t end = body.find("\n\n", at);
    EXPECT_NE(end, std::string::npos) << "an event without its blank line: " << body.substr(at);
    if (end == std::string::npos) break;
    const std::string event = body.substr(at, end - at);
    EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
    out.push_back(event.substr(6));
    at = end + 2;
  }
  return out;
}

}  // namespace rwt::server
