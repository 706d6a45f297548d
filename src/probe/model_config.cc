// model_config.cc — Hugging Face config.json to DecoderConfig, model specs (preset, text, path)
// resolved, the training options applied, and the summary a person reads before the plan.
#include "emsa/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "common/json.h"

namespace emsa {
namespace {

constexpr const char* kFamilies =
    "supported families: llama (model_type llama, mistral, qwen2) and gpt2 (model_type gpt2)";
constexpr int64_t kDefaultSeqLen = 2048;

// Reads config.json fields. Errors name the source and the field, as the file spells it.
class HfFields {
 public:
  HfFields(const json::Value& root, std::string source) : root_(root), source_(std::move(source)) {}

  Status Error(const std::string& field, const std::string& what) const {
    return Status::InvalidArgument(source_ + ": " + field + ": " + what);
  }

  bool Present(const char* field) const {
    const json::Value* v = root_.Find(field);
    return v != nullptr && !v->is_null();
  }

  // A required positive integer; `needs` lists the family's required fields for the message.
  Result<int64_t> Positive(const char* field, const char* needs) const {
    if (!Present(field)) {
      return Error(field, std::string("missing; ") + needs + " (" + kFamilies + ")");
    }
    return PositiveValue(field);
  }

  Result<int64_t> Positive(const char* field, int64_t def) const {
    if (!Present(field)) return def;
    return PositiveValue(field);
  }

  Status AtMost(const char* field, int64_t value, int64_t limit) const {
    if (value <= limit) return Status::Ok();
    return Error(field, std::to_string(value) + " exceeds the limit " + std::to_string(limit));
  }

  Result<bool> Flag(const char* field, bool def) const {
    if (!Present(field)) return def;
    const json::Value* v = root_.Find(field);
    if (!v->is_bool()) return Error(field, "expected true or false, got " + Show(*v));
    return v->as_bool();
  }

  Result<std::string> Text(const char* field) const {
    const json::Value* v = root_.Find(field);
    if (v == nullptr || v->is_null()) {
      return Error(field, std::string("missing; config.json names its architecture there (") +
                              kFamilies + ")");
    }
    if (!v->is_string()) return Error(field, "expected a string, got " + Show(*v));
    return v->as_string();
  }

 private:
  Result<int64_t> PositiveValue(const char* field) const {
    const json::Value* v = root_.Find(field);
    if (!v->is_int() || v->as_int() <= 0) {
      return Error(field, "expected a positive integer, got " + Show(*v));
    }
    return v->as_int();
  }

  static std::string Show(const json::Value& v) { return json::Write(v, -1); }

  const json::Value& root_;
  std::string source_;
};

constexpr const char* kLlamaNeeds =
    "a llama-family config.json needs hidden_size, intermediate_size, num_hidden_layers, "
    "num_attention_heads and vocab_size";
constexpr const char* kGpt2Needs =
    "a gpt2 config.json needs n_embd, n_layer, n_head, n_positions and vocab_size";

Status ReadLlama(const HfFields& f, const std::string& model_type, DecoderConfig* c) {
  c->family = ModelFamily::kLlama;
  EMSA_ASSIGN_OR_RETURN(c->hidden_size, f.Positive("hidden_size", kLlamaNeeds));
  EMSA_ASSIGN_OR_RETURN(c->intermediate_size, f.Positive("intermediate_size", kLlamaNeeds));
  EMSA_ASSIGN_OR_RETURN(c->num_layers, f.Positive("num_hidden_layers", kLlamaNeeds));
  EMSA_RETURN_IF_ERROR(f.AtMost("num_hidden_layers", c->num_layers, DecoderConfig::kMaxLayers));
  EMSA_ASSIGN_OR_RETURN(c->num_heads, f.Positive("num_attention_heads", kLlamaNeeds));
  EMSA_ASSIGN_OR_RETURN(c->vocab_size, f.Positive("vocab_size", kLlamaNeeds));
  EMSA_ASSIGN_OR_RETURN(c->num_kv_heads, f.Positive("num_key_value_heads", c->num_heads));
  EMSA_ASSIGN_OR_RETURN(c->tie_embeddings, f.Flag("tie_word_embeddings", false));
  EMSA_ASSIGN_OR_RETURN(c->max_position_embeddings,
                        f.Positive("max_position_embeddings", int64_t{0}));
  if (c->hidden_size % c->num_heads != 0) {
    return f.Error("num_attention_heads", std::to_string(c->num_heads) +
                                              " does not divide hidden_size " +
                                              std::to_string(c->hidden_size));
  }
  if (c->num_heads % c->num_kv_heads != 0) {
    return f.Error("num_key_value_heads", std::to_string(c->num_kv_heads) +
                                              " does not divide num_attention_heads " +
                                              std::to_string(c->num_heads));
  }
  EMSA_ASSIGN_OR_RETURN(const int64_t head_dim,
                        f.Positive("head_dim", c->hidden_size / c->num_heads));
  if (head_dim * c->num_heads != c->hidden_size) {
    return Status::Unsupported(f.Error("head_dim", "").message() + std::to_string(head_dim) +
                               " times num_attention_heads differs from hidden_size; "
                               "projections of another width are not modeled");
  }
  // Qwen2 always has q/k/v biases; Llama and Mistral have none unless attention_bias, which
  // puts one on o_proj too, a layout the analytic probe does not build.
  c->attention_bias = model_type == "qwen2";
  if (model_type != "qwen2") {
    for (const char* field : {"attention_bias", "mlp_bias"}) {
      EMSA_ASSIGN_OR_RETURN(const bool bias, f.Flag(field, false));
      if (bias) {
        return Status::Unsupported(f.Error(field, "").message() +
                                   "true (a bias on every projection) is not modeled; only "
                                   "Qwen2's q/k/v biases are");
      }
    }
  }
  return Status::Ok();
}

Status ReadGpt2(const HfFields& f, DecoderConfig* c) {
  c->family = ModelFamily::kGpt2;
  EMSA_ASSIGN_OR_RETURN(c->hidden_size, f.Positive("n_embd", kGpt2Needs));
  EMSA_ASSIGN_OR_RETURN(c->num_layers, f.Positive("n_layer", kGpt2Needs));
  EMSA_RETURN_IF_ERROR(f.AtMost("n_layer", c->num_layers, DecoderConfig::kMaxLayers));
  EMSA_ASSIGN_OR_RETURN(c->num_heads, f.Positive("n_head", kGpt2Needs));
  EMSA_ASSIGN_OR_RETURN(c->max_position_embeddings, f.Positive("n_positions", kGpt2Needs));
  EMSA_ASSIGN_OR_RETURN(c->vocab_size, f.Positive("vocab_size", kGpt2Needs));
  EMSA_ASSIGN_OR_RETURN(c->intermediate_size, f.Positive("n_inner", 4 * c->hidden_size));
  EMSA_ASSIGN_OR_RETURN(c->tie_embeddings, f.Flag("tie_word_embeddings", true));
  c->num_kv_heads = c->num_heads;
  c->attention_bias = false;
  if (c->hidden_size % c->num_heads != 0) {
    return f.Error("n_head", std::to_string(c->num_heads) + " does not divide n_embd " +
                                 std::to_string(c->hidden_size));
  }
  return Status::Ok();
}

bool LooksLikeJson(const std::string& spec) {
  const size_t first = spec.find_first_not_of(" \t\r\n");
  return first != std::string::npos && spec[first] == '{';
}

std::string Join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// ".../NAME/config.json" -> NAME; ".../foo.json" -> foo.
std::string NameFromPath(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  auto base = [](const std::string& p) {
    const size_t slash = p.rfind('/');
    return slash == std::string::npos ? p : p.substr(slash + 1);
  };
  std::string file = base(path);
  if (file == "config.json") {
    const size_t slash = path.rfind('/');
    if (slash != std::string::npos && slash > 0) {
      const std::string dir = base(path.substr(0, slash));
      if (!dir.empty() && dir != "." && dir != "..") return dir;
    }
  }
  const size_t dot = file.rfind('.');
  return dot == std::string::npos || dot == 0 ? file : file.substr(0, dot);
}

std::string Grouped(uint64_t n) {
  const std::string digits = std::to_string(n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string Ms(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f ms", seconds * 1e3);
  return buf;
}

}  // namespace

Result<DecoderConfig> DecoderConfigFromHfJson(const std::string& text, const std::string& name) {
  auto root = json::Parse(text);
  if (!root.ok()) return root.status().Annotate(name);
  if (!root->is_object()) {
    return Status::ParseError(name + ": a config.json is a JSON object ({...})");
  }
  const HfFields fields(*root, name);
  EMSA_ASSIGN_OR_RETURN(const std::string model_type, fields.Text("model_type"));
  DecoderConfig config;
  config.name = name;
  if (model_type == "llama" || model_type == "mistral" || model_type == "qwen2") {
    EMSA_RETURN_IF_ERROR(ReadLlama(fields, model_type, &config));
  } else if (model_type == "gpt2") {
    EMSA_RETURN_IF_ERROR(ReadGpt2(fields, &config));
  } else {
    return fields.Error("model_type", "\"" + model_type + "\" is not supported; " + kFamilies);
  }
  return config;
}

std::string SupportedModelTypes() { return kFamilies; }

Result<DecoderConfig> ResolveModel(const std::string& spec) {
  if (LooksLikeJson(spec)) return DecoderConfigFromHfJson(spec, "config.json");
  if (auto preset = ModelPresetText(spec); preset.ok()) {
    auto config = DecoderConfigFromHfJson(*preset, spec);
    if (!config.ok()) {
      return Status::Internal("the built-in model preset '" + spec +
                              "' does not parse: " + config.status().message());
    }
    return config;
  }
  // A bare name that is no preset may still be a folder here ("cfg-llama" for "./cfg-llama").
  std::error_code ignored;
  const bool path_like = spec.find('/') != std::string::npos ||
                         (spec.size() > 5 && spec.compare(spec.size() - 5, 5, ".json") == 0) ||
                         std::filesystem::exists(spec, ignored);
  if (!path_like) {
    return Status::NotFound("model '" + spec + "' is not a preset (" + Join(ModelPresetNames()) +
                            ") nor a path to a config.json");
  }
  if (!std::filesystem::is_directory(spec, ignored)) {
    EMSA_ASSIGN_OR_RETURN(const std::string text, json::ReadFile(spec));
    return DecoderConfigFromHfJson(text, NameFromPath(spec));
  }
  // A model directory, as Hugging Face lays them out.
  const std::string inner = spec + (spec.back() == '/' ? "" : "/") + "config.json";
  auto text = json::ReadFile(inner);
  if (!text.ok()) {
    return Status::IoError("'" + spec + "' is a folder without a readable config.json (" +
                           text.status().message() + ")");
  }
  return DecoderConfigFromHfJson(*text, NameFromPath(inner));
}

Result<ProbeRecord> ModelProbe(const std::string& spec, const ModelProbeOptions& options,
                               DecoderConfig* config_out) {
  if (options.batch <= 0) {
    return Status::InvalidArgument("batch: must be positive, got " + std::to_string(options.batch));
  }
  if (options.seq_len < 0) {
    return Status::InvalidArgument(
        "seq_len: must be positive (or 0 for the model's context), "
        "got " +
        std::to_string(options.seq_len));
  }
  if (DTypeSize(options.param_dtype) == 0) {
    return Status::InvalidArgument("param_dtype: not a known dtype; use fp32, bf16 or fp16");
  }
  if (!(std::isfinite(options.matmul_flops) && options.matmul_flops >= 0.0)) {
    return Status::InvalidArgument(
        "matmul_flops: must be a positive FLOP/s rate, or 0 for the default");
  }
  EMSA_ASSIGN_OR_RETURN(DecoderConfig config, ResolveModel(spec));
  config.batch = options.batch;
  config.seq_len = options.seq_len;
  if (config.seq_len == 0) {
    config.seq_len = config.max_position_embeddings > 0
                         ? std::min(config.max_position_embeddings, kDefaultSeqLen)
                         : kDefaultSeqLen;
  }
  if (config.family == ModelFamily::kGpt2 && config.seq_len > config.max_position_embeddings) {
    return Status::InvalidArgument("seq_len: " + std::to_string(config.seq_len) + " exceeds " +
                                   config.name + "'s n_positions " +
                                   std::to_string(config.max_position_embeddings) +
                                   " (GPT-2 has a learned position table); use " +
                                   std::to_string(config.max_position_embeddings) + " or less");
  }
  config.activation_checkpointing = options.activation_checkpointing;
  config.attention_scores_saved = options.eager_attention;
  config.dtype = options.param_dtype;
  if (options.matmul_flops > 0.0) config.matmul_flops = options.matmul_flops;
  auto record = AnalyticDecoderProbe(config);
  if (!record.ok()) return record.status().Annotate(config.name);
  if (config_out != nullptr) *config_out = config;
  return record;
}

std::string ModelSummary(const DecoderConfig& c, const ProbeRecord& r) {
  uint64_t numel = 0, params = 0, grads = 0;
  for (const ParamRecord& p : r.params) {
    numel += static_cast<uint64_t>(p.numel);
    params += p.bytes;
    if (p.trainable) grads += p.bytes;
  }
  const uint64_t activations = r.peak_device_bytes - std::min(r.peak_device_bytes, params + grads);
  char flops[32];
  std::snprintf(flops, sizeof flops, "%.0f TFLOP/s", c.matmul_flops / 1e12);
  std::string out;
  out += "model      " + c.name + ": " + ModelFamilyName(c.family) + " family, " + Grouped(numel) +
         " parameters (" + DTypeName(c.dtype) + ", " + FormatBytes(params) + ")\n";
  out += "           " + std::to_string(c.num_layers) + " layers, hidden " +
         std::to_string(c.hidden_size) + ", MLP " + std::to_string(c.intermediate_size) + ", " +
         std::to_string(c.num_heads) + " heads (" + std::to_string(c.num_kv_heads) +
         " kv), vocab " + std::to_string(c.vocab_size) +
         (c.tie_embeddings ? ", head tied to the embedding\n" : ", untied head\n");
  out += "training   batch " + std::to_string(c.batch) + " x seq " + std::to_string(c.seq_len) +
         (c.activation_checkpointing ? ", activation checkpointing" : "") +
         (c.attention_scores_saved ? ", eager attention (scores saved)" : "") +
         ", bf16 autocast (16-bit activations)\n";
  out += "probe      analytic at " + std::string(flops) + ": forward " + Ms(r.forward_time) +
         ", backward " + Ms(r.backward_time) + "\n";
  out += "           peak memory without optimizer state, every gradient held: " +
         FormatBytes(r.peak_device_bytes) + "\n           = parameters " + FormatBytes(params) +
         " + gradients " + FormatBytes(grads) + " + activations " + FormatBytes(activations) + "\n";
  return out;
}

}  // namespace emsa
