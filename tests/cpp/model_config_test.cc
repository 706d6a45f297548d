// Tests for emsa/model_config.h: Hugging Face config.json parsing per family, every error naming
// its field, exact parameter counts of the shipped presets, the embedded preset files, and the
// analytic probe's memory as batch, seq, checkpointing and param_dtype change.
#include "emsa/model_config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "common/json.h"

namespace emsa {
namespace {

const std::string kPresets = std::string(EMSA_SOURCE_DIR) + "/presets/";

DecoderConfig ParseOrDie(const std::string& text) {
  Result<DecoderConfig> c = DecoderConfigFromHfJson(text, "test");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : DecoderConfig{};
}

ProbeRecord ProbeOrDie(const std::string& spec, const ModelProbeOptions& options = {}) {
  Result<ProbeRecord> r = ModelProbe(spec, options);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : ProbeRecord{};
}

int64_t TotalNumel(const ProbeRecord& r) {
  int64_t n = 0;
  for (const ParamRecord& p : r.params) n += p.numel;
  return n;
}

const ParamRecord* Find(const ProbeRecord& r, const std::string& name) {
  for (const ParamRecord& p : r.params) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

std::string ReadOrDie(const std::string& path) {
  Result<std::string> text = json::ReadFile(path);
  EXPECT_TRUE(text.ok()) << text.status().ToString();
  return text.ok() ? *text : std::string();
}

// ---- parsing
// -------------------------------------------------------------------------------------

constexpr const char* kLlama = R"({
  "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
  "vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": true,
  "rms_norm_eps": 1e-05, "torch_dtype": "float16"})";

constexpr const char* kGpt2 = R"({
  "model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": null,
  "n_positions": 1024, "vocab_size": 50257})";

TEST(ModelConfig, LlamaFields) {
  const DecoderConfig c = ParseOrDie(kLlama);
  EXPECT_EQ(c.family, ModelFamily::kLlama);
  EXPECT_EQ(c.name, "test");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 11008);
  EXPECT_EQ(c.num_layers, 32);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_FALSE(c.attention_bias);
  // The checkpoint's torch_dtype is not the training dtype: the default stays.
  EXPECT_EQ(c.dtype, DType::kFloat32);
}

TEST(ModelConfig, LlamaDefaults) {
  const DecoderConfig c = ParseOrDie(R"({"model_type": "mistral", "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      "vocab_size": 100})");
  EXPECT_EQ(c.family, ModelFamily::kLlama);
  EXPECT_EQ(c.num_kv_heads, 4);  // absent: plain multi-head attention
  EXPECT_FALSE(c.tie_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 0);
  // A head_dim equal to hidden / heads is fine; null counts as absent.
  ParseOrDie(R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, "head_dim": 16,
      "num_key_value_heads": null, "attention_bias": false})");
}

TEST(ModelConfig, Qwen2HasQkvBiases) {
  const DecoderConfig c = ParseOrDie(R"({"model_type": "qwen2", "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "vocab_size": 100})");
  EXPECT_EQ(c.family, ModelFamily::kLlama);
  EXPECT_TRUE(c.attention_bias);
}

TEST(ModelConfig, Gpt2Fields) {
  const DecoderConfig c = ParseOrDie(kGpt2);
  EXPECT_EQ(c.family, ModelFamily::kGpt2);
  EXPECT_EQ(c.hidden_size, 768);
  EXPECT_EQ(c.intermediate_size, 4 * 768);  // n_inner null
  EXPECT_EQ(c.num_layers, 12);
  EXPECT_EQ(c.num_heads, 12);
  EXPECT_EQ(c.num_kv_heads, 12);
  EXPECT_EQ(c.max_position_embeddings, 1024);
  EXPECT_EQ(c.vocab_size, 50257);
  EXPECT_TRUE(c.tie_embeddings);  // GPT2LMHeadModel ties its head by default
  const DecoderConfig inner = ParseOrDie(R"({"model_type": "gpt2", "n_embd": 64, "n_layer": 1,
      "n_head": 4, "n_inner": 100, "n_positions": 32, "vocab_size": 10,
      "tie_word_embeddings": false})");
  EXPECT_EQ(inner.intermediate_size, 100);
  EXPECT_FALSE(inner.tie_embeddings);
}

// Removes one key from a config's text (each test config writes it as "key": value).
std::string Without(const std::string& text, const std::string& key) {
  json::Value root = json::Parse(text).value();
  json::Value::Object kept;
  for (auto& [k, v] : root.as_object()) {
    if (k != key) kept.emplace_back(k, v);
  }
  return json::Write(json::Value(kept), -1);
}

TEST(ModelConfig, EveryMissingRequiredFieldIsNamed) {
  struct Family {
    const char* text;
    std::vector<const char*> required;
  } families[] = {
      {kLlama,
       {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "vocab_size", "model_type"}},
      {kGpt2, {"n_embd", "n_layer", "n_head", "n_positions", "vocab_size", "model_type"}},
  };
  for (const Family& f : families) {
    for (const char* field : f.required) {
      SCOPED_TRACE(field);
      Result<DecoderConfig> c = DecoderConfigFromHfJson(Without(f.text, field), "cfg.json");
      ASSERT_FALSE(c.ok());
      EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
      const std::string& m = c.status().message();
      EXPECT_NE(m.find(std::string("cfg.json: ") + field + ": missing"), std::string::npos) << m;
      EXPECT_NE(m.find("supported families: llama"), std::string::npos) << m;
      EXPECT_NE(m.find("gpt2"), std::string::npos) << m;
    }
  }
}

TEST(ModelConfig, BadValuesNameTheField) {
  struct Case {
    std::string text;
    const char* says;
    StatusCode code;
  } cases[] = {
      {R"({"model_type": "gemma", "hidden_size": 64})",
       "model_type: \"gemma\" is not supported; supported families: llama (model_type llama, "
       "mistral, qwen2) and gpt2",
       StatusCode::kInvalidArgument},
      {R"({"model_type": 7})", "model_type: expected a string, got 7",
       StatusCode::kInvalidArgument},
      {Without(kLlama, "hidden_size") + "", "hidden_size: missing", StatusCode::kInvalidArgument},
      {R"({"model_type": "llama", "hidden_size": "4096", "intermediate_size": 1,
          "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 1})",
       "hidden_size: expected a positive integer, got \"4096\"", StatusCode::kInvalidArgument},
      {R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 0,
          "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 1})",
       "intermediate_size: expected a positive integer, got 0", StatusCode::kInvalidArgument},
      {R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 1,
          "num_hidden_layers": 1.5, "num_attention_heads": 1, "vocab_size": 1})",
       "num_hidden_layers: expected a positive integer, got 1.5", StatusCode::kInvalidArgument},
      {R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 1,
          "num_hidden_layers": 1, "num_attention_heads": 5, "vocab_size": 1})",
       "num_attention_heads: 5 does not divide hidden_size 64", StatusCode::kInvalidArgument},
      {R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 1,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 3,
          "vocab_size": 1})",
       "num_key_value_heads: 3 does not divide num_attention_heads 4",
       StatusCode::kInvalidArgument},
      {R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 1,
          "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 1,
          "tie_word_embeddings": "yes"})",
       "tie_word_embeddings: expected true or false", StatusCode::kInvalidArgument},
      {R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 1,
          "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 1, "head_dim": 32})",
       "head_dim: 32 times num_attention_heads differs from hidden_size", StatusCode::kUnsupported},
      {R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 1,
          "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 1,
          "attention_bias": true})",
       "attention_bias: true (a bias on every projection) is not modeled",
       StatusCode::kUnsupported},
      {R"({"model_type": "mistral", "hidden_size": 64, "intermediate_size": 1,
          "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 1,
          "mlp_bias": true})",
       "mlp_bias: true", StatusCode::kUnsupported},
      {R"({"model_type": "gpt2", "n_embd": 64, "n_layer": 1, "n_head": 3, "n_positions": 8,
          "vocab_size": 1})",
       "n_head: 3 does not divide n_embd 64", StatusCode::kInvalidArgument},
      {R"({"model_type": "gpt2", "n_embd": 64, "n_layer": 1, "n_head": 4, "n_positions": -8,
          "vocab_size": 1})",
       "n_positions: expected a positive integer, got -8", StatusCode::kInvalidArgument},
      {"[1, 2]", "a config.json is a JSON object", StatusCode::kParseError},
      {"{\"model_type\": ", "test", StatusCode::kParseError},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.says);
    Result<DecoderConfig> c = DecoderConfigFromHfJson(k.text, "test");
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), k.code) << c.status().ToString();
    EXPECT_NE(c.status().message().find(k.says), std::string::npos) << c.status().message();
    EXPECT_EQ(c.status().message().rfind("test", 0), 0u) << c.status().message();
  }
}

// ---- presets and exact parameter counts
// ----------------------------------------------------------

TEST(ModelPresets, ParameterCountsMatchTheRealModels) {
  // Counted from the Hugging Face models (sum of p.numel() over model.parameters(), tied
  // tensors once).
  const struct {
    const char* name;
    int64_t params;
    ModelFamily family;
  } models[] = {
      {"llama-2-7b", 6738415616, ModelFamily::kLlama},
      {"mistral-7b", 7241732096, ModelFamily::kLlama},
      {"gpt2-xl", 1557611200, ModelFamily::kGpt2},
      {"qwen2.5-7b", 7615616512, ModelFamily::kLlama},
      {"llama-3-8b", 8030261248, ModelFamily::kLlama},
      {"tinyllama-1.1b", 1100048384, ModelFamily::kLlama},
  };
  for (const auto& m : models) {
    SCOPED_TRACE(m.name);
    DecoderConfig config;
    ModelProbeOptions options;
    options.seq_len = 128;
    Result<ProbeRecord> r = ModelProbe(m.name, options, &config);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(TotalNumel(*r), m.params);
    EXPECT_EQ(config.family, m.family);
    EXPECT_EQ(config.name, m.name);
    EXPECT_EQ(r->model, m.name);
  }
}

TEST(ModelPresets, Gpt2NamesAndShapesFollowHuggingFace) {
  ModelProbeOptions options;
  options.seq_len = 64;
  const ProbeRecord r = ProbeOrDie("gpt2-xl", options);
  const struct {
    const char* name;
    std::vector<int64_t> shape;
  } head[] = {
      {"transformer.wte.weight", {50257, 1600}},
      {"transformer.wpe.weight", {1024, 1600}},
      {"transformer.h.0.ln_1.weight", {1600}},
      {"transformer.h.0.ln_1.bias", {1600}},
      {"transformer.h.0.attn.c_attn.weight", {1600, 4800}},
      {"transformer.h.0.attn.c_attn.bias", {4800}},
      {"transformer.h.0.attn.c_proj.weight", {1600, 1600}},
      {"transformer.h.0.attn.c_proj.bias", {1600}},
      {"transformer.h.0.ln_2.weight", {1600}},
      {"transformer.h.0.ln_2.bias", {1600}},
      {"transformer.h.0.mlp.c_fc.weight", {1600, 6400}},
      {"transformer.h.0.mlp.c_fc.bias", {6400}},
      {"transformer.h.0.mlp.c_proj.weight", {6400, 1600}},
      {"transformer.h.0.mlp.c_proj.bias", {1600}},
      {"transformer.h.1.ln_1.weight", {1600}},
  };
  ASSERT_EQ(r.params.size(), 2u + 48 * 12 + 2);
  for (size_t i = 0; i < std::size(head); ++i) {
    EXPECT_EQ(r.params[i].name, head[i].name);
    EXPECT_EQ(r.params[i].shape, head[i].shape) << head[i].name;
  }
  EXPECT_EQ(r.params.back().name, "transformer.ln_f.bias");
  EXPECT_EQ(r.params[r.params.size() - 2].name, "transformer.ln_f.weight");
  // The head is the token embedding under a second name; its gradient is final last.
  const ParamRecord& wte = r.params.front();
  EXPECT_EQ(wte.tied_names, (std::vector<std::string>{"lm_head.weight"}));
  EXPECT_EQ(wte.use_count, 2);
  EXPECT_EQ(wte.grad_ready_order, static_cast<int64_t>(r.params.size()) - 1);
  EXPECT_EQ(Find(r, "lm_head.weight"), nullptr);
  EXPECT_EQ(Find(r, "transformer.h.47.mlp.c_proj.bias")->module, "transformer.h.47.mlp.c_proj");
  // Memory samples name the GPT-2 layers.
  bool saw_layer = false;
  for (const MemorySample& m : r.memory) saw_layer |= m.module == "transformer.h.47";
  EXPECT_TRUE(saw_layer);
}

TEST(ModelPresets, Qwen2BiasesOnQkvOnly) {
  ModelProbeOptions options;
  options.seq_len = 64;
  const ProbeRecord r = ProbeOrDie("qwen2.5-7b", options);
  for (const char* proj : {"q_proj", "k_proj", "v_proj"}) {
    EXPECT_NE(Find(r, std::string("model.layers.27.self_attn.") + proj + ".bias"), nullptr);
  }
  EXPECT_EQ(Find(r, "model.layers.27.self_attn.o_proj.bias"), nullptr);
  EXPECT_EQ(Find(r, "model.layers.0.self_attn.k_proj.bias")->shape, (std::vector<int64_t>{512}));
  ASSERT_NE(Find(r, "lm_head.weight"), nullptr);
}

std::set<std::string> JsonStems(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() == ".json") out.insert(entry.path().stem().string());
  }
  return out;
}

TEST(ModelPresets, EmbeddedTextEqualsTheFiles) {
  const std::vector<std::string> models = ModelPresetNames();
  const std::vector<std::string> devices = DevicePresetNames();
  EXPECT_EQ(std::set<std::string>(models.begin(), models.end()), JsonStems(kPresets + "models"));
  EXPECT_EQ(std::set<std::string>(devices.begin(), devices.end()), JsonStems(kPresets + "devices"));
  EXPECT_EQ(models, (std::vector<std::string>{"gpt2-xl", "llama-2-7b", "llama-3-8b", "mistral-7b",
                                              "qwen2.5-7b", "tinyllama-1.1b"}));
  EXPECT_EQ(devices, (std::vector<std::string>{"a100-40gb", "h200", "rtx-4090"}));
  for (const std::string& name : models) {
    SCOPED_TRACE(name);
    Result<std::string> text = ModelPresetText(name);
    ASSERT_TRUE(text.ok());
    EXPECT_TRUE(*text == ReadOrDie(kPresets + "models/" + name + ".json"))
        << "rebuild: the library embeds presets/ at build time";
  }
  for (const std::string& name : devices) {
    SCOPED_TRACE(name);
    Result<std::string> text = DevicePresetText(name);
    ASSERT_TRUE(text.ok());
    EXPECT_TRUE(*text == ReadOrDie(kPresets + "devices/" + name + ".json"));
  }
}

TEST(ModelPresets, UnknownNamesListTheKnownOnes) {
  Result<std::string> m = ModelPresetText("llama-9");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
  EXPECT_NE(m.status().message().find("gpt2-xl, llama-2-7b"), std::string::npos);
  Result<DevicePreset> d = LoadDevicePreset("tpu");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kNotFound);
  EXPECT_NE(d.status().message().find("a100-40gb, h200, rtx-4090"), std::string::npos);
  Result<DecoderConfig> spec = ResolveModel("llama-9");
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), StatusCode::kNotFound);
  EXPECT_NE(spec.status().message().find("tinyllama-1.1b"), std::string::npos);
  Result<DecoderConfig> path = ResolveModel("/nonexistent/config.json");
  ASSERT_FALSE(path.ok());
  EXPECT_EQ(path.status().code(), StatusCode::kIoError);
}

TEST(DevicePresets, ParseWithTheirMatmulRate) {
  for (const std::string& name : DevicePresetNames()) {
    SCOPED_TRACE(name);
    Result<DevicePreset> p = LoadDevicePreset(name);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_TRUE(p->profile.gpu.present);
    EXPECT_GT(p->matmul_flops, 1e13);
    EXPECT_GT(p->profile.gpu.hbm_bandwidth, p->profile.gpu.h2d_bandwidth);
    EXPECT_LT(p->profile.gpu.free_memory, p->profile.gpu.total_memory);
    EXPECT_LE(p->profile.gpu.max_persisting_l2_bytes, p->profile.gpu.l2_bytes);
  }
  // The H200 preset is the repo's example profile plus its matmul rate.
  const DevicePreset h200 = LoadDevicePreset("h200").value();
  const DeviceProfile example = DeviceProfileFromJson(ReadOrDie(std::string(EMSA_SOURCE_DIR) +
                                                                "/examples/profiles/h200.json"))
                                    .value();
  EXPECT_EQ(DeviceProfileToJson(h200.profile), DeviceProfileToJson(example));
  EXPECT_EQ(h200.matmul_flops, DecoderConfig{}.matmul_flops);
  // The others scale from it: slower memory, slower links, slower math.
  for (const char* name : {"a100-40gb", "rtx-4090"}) {
    const DevicePreset p = LoadDevicePreset(name).value();
    EXPECT_LT(p.profile.gpu.hbm_bandwidth, h200.profile.gpu.hbm_bandwidth) << name;
    EXPECT_LT(p.profile.gpu.h2d_bandwidth, h200.profile.gpu.h2d_bandwidth) << name;
    EXPECT_LT(p.matmul_flops, h200.matmul_flops) << name;
  }
}

TEST(DevicePresets, MatmulRateIsOptionalButMustBePositive) {
  const std::string profile = DeviceProfileToJson(LoadDevicePreset("h200").value().profile);
  Result<DevicePreset> plain = DevicePresetFromJson(profile);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->matmul_flops, 0.0);
  std::string bad = profile;
  bad.insert(bad.find('{') + 1, "\"matmul_flops\": -1,");
  Result<DevicePreset> negative = DevicePresetFromJson(bad);
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.status().message().find("matmul_flops"), std::string::npos);
}

// ---- models from files and text
// ------------------------------------------------------------------

DecoderConfig ResolveOrDie(const std::string& spec) {
  Result<DecoderConfig> c = ResolveModel(spec);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : DecoderConfig{};
}

TEST(ModelSpec, PathsDirectoriesAndText) {
  const std::string root = ::testing::TempDir() + "emsa_model_spec_" + std::to_string(getpid());
  const std::string dir = root + "/my-model";
  std::filesystem::create_directories(dir);
  ASSERT_TRUE(json::WriteFile(dir + "/config.json", kGpt2).ok());
  ASSERT_TRUE(json::WriteFile(root + "/small.json", kLlama).ok());
  const DecoderConfig by_file = ResolveOrDie(dir + "/config.json");
  EXPECT_EQ(by_file.name, "my-model");
  EXPECT_EQ(by_file.family, ModelFamily::kGpt2);
  const DecoderConfig by_dir = ResolveOrDie(dir);
  EXPECT_EQ(by_dir.name, "my-model");
  EXPECT_EQ(by_dir.hidden_size, 768);
  EXPECT_EQ(ResolveOrDie(root + "/small.json").name, "small");
  const DecoderConfig by_text = ResolveOrDie(std::string("  \n") + kLlama);
  EXPECT_EQ(by_text.hidden_size, 4096);
  EXPECT_EQ(by_text.name, "config.json");
  // A folder without a config.json, and a file that is not one.
  Result<DecoderConfig> empty = ResolveModel(root);
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), StatusCode::kIoError);
  EXPECT_NE(empty.status().message().find("without a readable config.json"), std::string::npos);
  ASSERT_TRUE(json::WriteFile(root + "/broken.json", "{\"model_type\": \"llama\"}").ok());
  Result<DecoderConfig> broken = ResolveModel(root + "/broken.json");
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.status().message().find("broken: hidden_size: missing"), std::string::npos)
      << broken.status().message();
  std::filesystem::remove_all(root);
}

TEST(ModelProbeOptionsTest, DefaultsAndErrors) {
  DecoderConfig config;
  ASSERT_TRUE(ModelProbe("llama-2-7b", {}, &config).ok());
  EXPECT_EQ(config.seq_len, 2048);  // context 4096, capped
  EXPECT_EQ(config.batch, 1);
  ASSERT_TRUE(ModelProbe("gpt2-xl", {}, &config).ok());
  EXPECT_EQ(config.seq_len, 1024);  // the model's context
  ModelProbeOptions o;
  o.matmul_flops = 100e12;
  ASSERT_TRUE(ModelProbe("tinyllama-1.1b", o, &config).ok());
  EXPECT_EQ(config.matmul_flops, 100e12);

  const struct {
    std::function<void(ModelProbeOptions&)> edit;
    const char* says;
  } cases[] = {
      {[](ModelProbeOptions& m) { m.batch = 0; }, "batch"},
      {[](ModelProbeOptions& m) { m.seq_len = -1; }, "seq_len"},
      {[](ModelProbeOptions& m) { m.seq_len = 2048; },
       "seq_len: 2048 exceeds gpt2-xl's n_positions 1024"},
      {[](ModelProbeOptions& m) { m.matmul_flops = -5; }, "matmul_flops"},
      {[](ModelProbeOptions& m) { m.param_dtype = static_cast<DType>(9); }, "param_dtype"},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(k.says);
    ModelProbeOptions bad;
    k.edit(bad);
    Result<ProbeRecord> r = ModelProbe("gpt2-xl", bad);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(k.says), std::string::npos) << r.status().message();
  }
}

// ---- activation memory
// ---------------------------------------------------------------------------

uint64_t Peak(const char* model, int64_t batch, int64_t seq, bool checkpointing,
              DType dtype = DType::kBFloat16) {
  ModelProbeOptions o;
  o.batch = batch;
  o.seq_len = seq;
  o.activation_checkpointing = checkpointing;
  o.param_dtype = dtype;
  return ProbeOrDie(model, o).peak_device_bytes;
}

TEST(ModelMemory, ActivationsGrowWithBatchAndSeqAndShrinkWithCheckpointing) {
  for (const char* model : {"llama-2-7b", "gpt2-xl", "qwen2.5-7b"}) {
    SCOPED_TRACE(model);
    for (bool ckpt : {false, true}) {
      uint64_t last = 0;
      for (int64_t batch : {1, 2, 4, 8}) {
        const uint64_t peak = Peak(model, batch, 512, ckpt);
        EXPECT_GT(peak, last) << "batch " << batch;
        last = peak;
      }
      last = 0;
      for (int64_t seq : {128, 256, 512, 1024}) {
        const uint64_t peak = Peak(model, 2, seq, ckpt);
        EXPECT_GT(peak, last) << "seq " << seq;
        last = peak;
      }
    }
    for (int64_t batch : {1, 4}) {
      EXPECT_LT(Peak(model, batch, 1024, true), Peak(model, batch, 1024, false));
    }
  }
}

TEST(ModelMemory, CheckpointingKeepsEachLayersInputPlusOneLayer) {
  // llama-2-7b in bf16: the activations beyond parameters and gradients, exactly (fused
  // attention: no scores saved).
  const uint64_t b = 2, s = 1024, h = 4096, layers = 32, vocab = 32000;
  const uint64_t params = 2ull * 6738415616;
  const uint64_t full_layer = 34 * h * b * s;
  const uint64_t logits = b * s * vocab * 4;
  EXPECT_EQ(Peak("llama-2-7b", 2, 1024, false), 2 * params + layers * full_layer + 2 * logits);
  EXPECT_EQ(Peak("llama-2-7b", 2, 1024, true),
            2 * params + layers * 2 * b * s * h + full_layer + 2 * logits);
}

TEST(ModelMemory, EagerAttentionSavesTheScoresOfOneLayerWithCheckpointing) {
  ModelProbeOptions o;
  o.seq_len = 2048;
  o.activation_checkpointing = true;
  const uint64_t fused = ProbeOrDie("llama-2-7b", o).peak_device_bytes;
  o.eager_attention = true;
  const uint64_t eager = ProbeOrDie("llama-2-7b", o).peak_device_bytes;
  EXPECT_EQ(eager - fused, 5ull * 32 * 2048 * 1 * 2048);  // 5*a*s * b*s, one layer
  o.activation_checkpointing = false;
  const uint64_t all_layers = ProbeOrDie("llama-2-7b", o).peak_device_bytes;
  o.eager_attention = false;
  EXPECT_EQ(all_layers - ProbeOrDie("llama-2-7b", o).peak_device_bytes,
            32ull * 5 * 32 * 2048 * 2048);  // every layer's scores
}

TEST(ModelMemory, ParamDtypeSizesParametersAndGradientsOnly) {
  const uint64_t n = 6738415616;
  const uint64_t bf16 = Peak("llama-2-7b", 1, 2048, true, DType::kBFloat16);
  const uint64_t fp16 = Peak("llama-2-7b", 1, 2048, true, DType::kFloat16);
  const uint64_t fp32 = Peak("llama-2-7b", 1, 2048, true, DType::kFloat32);
  EXPECT_EQ(fp16, bf16);
  EXPECT_EQ(fp32 - bf16, 2 * (4 - 2) * n);  // parameters and gradients, 2 bytes more each
  ModelProbeOptions o;
  o.param_dtype = DType::kBFloat16;
  for (const ParamRecord& p : ProbeOrDie("mistral-7b", o).params) {
    ASSERT_EQ(p.dtype, DType::kBFloat16) << p.name;
    ASSERT_EQ(p.bytes, 2 * static_cast<uint64_t>(p.numel)) << p.name;
  }
}

TEST(ModelSummaryTest, SaysWhatAPersonNeeds) {
  ModelProbeOptions o;
  o.seq_len = 2048;
  o.activation_checkpointing = true;
  o.param_dtype = DType::kBFloat16;
  DecoderConfig config;
  const ProbeRecord r = ModelProbe("llama-2-7b", o, &config).value();
  const std::string s = ModelSummary(config, r);
  for (const char* part :
       {"llama-2-7b: llama family, 6,738,415,616 parameters (bfloat16, 12.55 GiB)",
        "32 heads (32 kv)", "batch 1 x seq 2048, activation checkpointing", "bf16 autocast",
        "400 TFLOP/s", "untied head"}) {
    EXPECT_NE(s.find(part), std::string::npos) << part << "\n" << s;
  }
  EXPECT_EQ(s.back(), '\n');
}

}  // namespace
}  // namespace emsa
