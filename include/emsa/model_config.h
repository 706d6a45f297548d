// emsa/model_config.h — a DecoderConfig from a Hugging Face config.json, and the presets built
// into the library: model configs (presets/models/*.json, written as config.json files) and
// device profiles (presets/devices/*.json, DeviceProfile JSON). Presets are embedded at build
// time, so nothing here reads a data path at run time. Pure functions; thread-safe.
//
// config.json fields read (others are ignored):
//   model_type "llama", "mistral", "qwen2" -> ModelFamily::kLlama
//     hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size
//     (required); num_key_value_heads (default: num_attention_heads); tie_word_embeddings
//     (default false); max_position_embeddings (optional). qwen2 has q/k/v biases. A head_dim
//     other than hidden_size / num_attention_heads, or attention_bias / mlp_bias = true on
//     llama or mistral (biases on every projection), is kUnsupported: not modeled.
//   model_type "gpt2" -> ModelFamily::kGpt2
//     n_embd, n_layer, n_head, n_positions, vocab_size (required); n_inner (null or absent:
//     4 * n_embd); tie_word_embeddings (default true).
// The checkpoint's torch_dtype is not read: the dtype used in training is a choice
// (ModelProbeOptions::param_dtype), not a property of the file.
#pragma once

#include <string>
#include <vector>

#include "emsa/analytic_probe.h"
#include "emsa/probe_record.h"
#include "emsa/profile.h"
#include "emsa/status.h"
#include "emsa/types.h"

namespace emsa {

// Parses config.json text. `name` becomes DecoderConfig::name and prefixes messages. Errors:
// kParseError for text that is not a JSON object; kInvalidArgument naming the field for a
// missing or mistyped field or an unknown model_type (the message lists the supported
// families); kUnsupported for the features above. Training fields (batch, seq_len, dtype,
// checkpointing, matmul_flops) keep DecoderConfig's defaults.
Result<DecoderConfig> DecoderConfigFromHfJson(const std::string& text, const std::string& name);

// The built-in presets, sorted by name: "llama-2-7b", ..., and "h200", "a100-40gb", ...
std::vector<std::string> ModelPresetNames();
// The config.json model types ResolveModel reads, by family, for a person (`emsa plan --list`).
std::string SupportedModelTypes();
std::vector<std::string> DevicePresetNames();
// The preset file's exact text; kNotFound listing the names that exist.
Result<std::string> ModelPresetText(const std::string& name);
Result<std::string> DevicePresetText(const std::string& name);

// A model given as a preset name, as config.json text (first non-blank character '{'), or as a
// path to a config.json file or to a directory holding one. The name is the preset's, or the
// directory's for ".../NAME/config.json", or the file's stem. kNotFound when the spec is none
// of these (the message lists the presets); kIoError for an unreadable file.
Result<DecoderConfig> ResolveModel(const std::string& spec);

// How the model is trained, for the analytic probe.
struct ModelProbeOptions {
  int64_t batch = 1;
  int64_t seq_len = 0;  // 0: the model's context (max_position_embeddings), at most 2048
  bool activation_checkpointing = false;
  bool eager_attention = false;  // the attention scores saved for backward (default: fused)
  // The parameters on the device: bf16 (default: what fine-tuning a 7 B model on one card uses;
  // emsa keeps their fp32 master in the optimizer state), fp32 or fp16.
  DType param_dtype = DType::kBFloat16;
  double matmul_flops = 0.0;  // FLOP/s; 0: DecoderConfig's default (400e12)
};

// ResolveModel, then the options applied, then AnalyticDecoderProbe. *config_out (when given)
// receives the config the record was made from. Bad options: kInvalidArgument naming the option
// (batch, seq_len, param_dtype, matmul_flops).
Result<ProbeRecord> ModelProbe(const std::string& spec, const ModelProbeOptions& options,
                               DecoderConfig* config_out = nullptr);

// A few lines for a person: family, parameter count and bytes, shape, training setup, and the
// probe's times and device peak (parameters + gradients + activations), ending in '\n'.
std::string ModelSummary(const DecoderConfig& config, const ProbeRecord& record);

// A device profile plus the dense bf16 matmul rate the analytic probe should assume on it.
struct DevicePreset {
  DeviceProfile profile;
  double matmul_flops = 0.0;  // FLOP/s; 0: not given (use DecoderConfig's default)
};
// DeviceProfile JSON with an optional top-level "matmul_flops" (a positive number). Errors as
// DeviceProfileFromJson's, or kParseError naming matmul_flops.
Result<DevicePreset> DevicePresetFromJson(const std::string& text);
// The built-in preset of that name; kNotFound listing the names.
Result<DevicePreset> LoadDevicePreset(const std::string& name);

}  // namespace emsa
