// analytic_probe.cc — a decoder's ProbeRecord (Llama or GPT-2 names) from its shape and a
// roofline.
#include "emsa/analytic_probe.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace emsa {
namespace {

// A stretch of the forward pass owned by one module (or, for the attention core, by no
// parameter). Backward walks the same stretches in reverse.
struct Segment {
  std::string module;
  int64_t layer = -1;          // decoder layer, -1 outside the layers
  double flops = 0.0;          // forward FLOPs
  std::vector<size_t> params;  // indices into ProbeRecord::params
  double start = 0.0;          // s, forward start
  double backward_end = 0.0;   // s, when this stretch's backward finishes
};

Status CheckPositive(int64_t v, const char* field) {
  if (v > 0) return Status::Ok();
  return Status::InvalidArgument(std::string("DecoderConfig.") + field +
                                 ": must be positive, got " + std::to_string(v));
}

Status CheckConfig(const DecoderConfig& c) {
  EMSA_RETURN_IF_ERROR(CheckPositive(c.vocab_size, "vocab_size"));
  EMSA_RETURN_IF_ERROR(CheckPositive(c.hidden_size, "hidden_size"));
  EMSA_RETURN_IF_ERROR(CheckPositive(c.intermediate_size, "intermediate_size"));
  EMSA_RETURN_IF_ERROR(CheckPositive(c.num_layers, "num_layers"));
  EMSA_RETURN_IF_ERROR(CheckPositive(c.num_heads, "num_heads"));
  EMSA_RETURN_IF_ERROR(CheckPositive(c.num_kv_heads, "num_kv_heads"));
  EMSA_RETURN_IF_ERROR(CheckPositive(c.batch, "batch"));
  EMSA_RETURN_IF_ERROR(CheckPositive(c.seq_len, "seq_len"));
  if (c.hidden_size % c.num_heads != 0) {
    return Status::InvalidArgument("DecoderConfig.num_heads: hidden_size " +
                                   std::to_string(c.hidden_size) +
                                   " is not divisible by num_heads " + std::to_string(c.num_heads));
  }
  if (c.num_heads % c.num_kv_heads != 0) {
    return Status::InvalidArgument(
        "DecoderConfig.num_kv_heads: num_heads " + std::to_string(c.num_heads) +
        " is not divisible by num_kv_heads " + std::to_string(c.num_kv_heads));
  }
  if (!(std::isfinite(c.matmul_flops) && c.matmul_flops > 0)) {
    return Status::InvalidArgument("DecoderConfig.matmul_flops: must be a positive FLOP/s rate");
  }
  if (DTypeSize(c.dtype) == 0) {
    return Status::InvalidArgument("DecoderConfig.dtype: not a known DType value");
  }
  if (c.family != ModelFamily::kLlama && c.family != ModelFamily::kGpt2) {
    return Status::InvalidArgument(
        "DecoderConfig.family: " + std::to_string(static_cast<int>(c.family)) +
        " is not a ModelFamily; use kLlama or kGpt2");
  }
  if (c.max_position_embeddings < 0) {
    return Status::InvalidArgument("DecoderConfig.max_position_embeddings: must not be negative");
  }
  if (c.family == ModelFamily::kGpt2) {
    EMSA_RETURN_IF_ERROR(CheckPositive(c.max_position_embeddings, "max_position_embeddings"));
    if (c.num_kv_heads != c.num_heads) {
      return Status::InvalidArgument(
          "DecoderConfig.num_kv_heads: GPT-2 has no grouped-query attention; set it equal to "
          "num_heads (" +
          std::to_string(c.num_heads) + ")");
    }
    if (c.seq_len > c.max_position_embeddings) {
      return Status::InvalidArgument("DecoderConfig.seq_len: " + std::to_string(c.seq_len) +
                                     " exceeds max_position_embeddings " +
                                     std::to_string(c.max_position_embeddings) +
                                     " (GPT-2's position table); use a shorter sequence");
    }
  }
  if (c.num_layers > DecoderConfig::kMaxLayers) {
    return Status::InvalidArgument("DecoderConfig.num_layers: " + std::to_string(c.num_layers) +
                                   " exceeds the limit " +
                                   std::to_string(DecoderConfig::kMaxLayers));
  }
  // Reject shapes whose record would pass the probe record's byte limit (and so overflow no
  // 64-bit count below); doubles have the range to tell. The parameter count is an upper bound
  // (every norm and bias counted, fp32), the peak the one Builder::Memory() sums.
  const double h = static_cast<double>(c.hidden_size);
  const double inner = static_cast<double>(c.intermediate_size);
  const double layer_params = 4.0 * h * h + 3.0 * h * inner + 10.0 * h + inner;
  const double params = static_cast<double>(c.num_layers + 1) * layer_params +
                        h * (2.0 * static_cast<double>(c.vocab_size) +
                             static_cast<double>(c.max_position_embeddings) + 2.0);
  const double tokens = static_cast<double>(c.batch) * static_cast<double>(c.seq_len);
  const double activations =
      static_cast<double>(c.num_layers + 1) * tokens *
          (34.0 * h + 5.0 * static_cast<double>(c.num_heads) * static_cast<double>(c.seq_len)) +
      8.0 * tokens * static_cast<double>(c.vocab_size);
  const double limit = static_cast<double>(ProbeRecord::kMaxBytes);
  if (params * 4.0 > limit || 2.0 * params * 4.0 + activations > limit) {
    return Status::InvalidArgument(
        "DecoderConfig: the parameters, gradients and activations pass 1 PiB (2^50 bytes), the "
        "most emsa plans for; check vocab_size, hidden_size, intermediate_size, "
        "num_layers, batch and seq_len");
  }
  return Status::Ok();
}

std::string LayerPrefix(ModelFamily family, int64_t layer) {
  return (family == ModelFamily::kGpt2 ? "transformer.h." : "model.layers.") +
         std::to_string(layer);
}

class Builder {
 public:
  explicit Builder(const DecoderConfig& c)
      : c_(c), tokens_(static_cast<double>(c.batch) * static_cast<double>(c.seq_len)) {}

  // A module with parameters; its forward costs 2 FLOPs per parameter per token (a matmul, or
  // close enough for the norms, whose cost is negligible either way).
  void Module(const std::string& module, int64_t layer,
              std::vector<std::pair<const char*, std::vector<int64_t>>> tensors) {
    Segment seg;
    seg.module = module;
    seg.layer = layer;
    for (auto& [suffix, shape] : tensors) {
      ParamRecord p;
      p.name = module + "." + suffix;
      p.module = module;
      p.numel = 1;
      for (int64_t d : shape) p.numel *= d;
      p.shape = std::move(shape);
      p.dtype = c_.dtype;
      p.bytes = static_cast<uint64_t>(p.numel) * DTypeSize(c_.dtype);
      seg.flops += 2.0 * static_cast<double>(p.numel) * tokens_;
      seg.params.push_back(record_.params.size());
      record_.params.push_back(std::move(p));
    }
    segments_.push_back(std::move(seg));
  }

  // Cost without parameters of its own: the attention core, or a tied head's matmul.
  void Compute(const std::string& module, int64_t layer, double flops) {
    Segment seg;
    seg.module = module;
    seg.layer = layer;
    seg.flops = flops;
    segments_.push_back(std::move(seg));
  }

  void Embedding() {
    if (c_.family == ModelFamily::kGpt2) {
      Gather("transformer.wte", c_.vocab_size);
      Gather("transformer.wpe", c_.max_position_embeddings);
    } else {
      Gather("model.embed_tokens", c_.vocab_size);
    }
  }

  void Layer(int64_t i) {
    if (c_.family == ModelFamily::kGpt2) {
      Gpt2Layer(i);
    } else {
      LlamaLayer(i);
    }
  }

  void Head() {
    if (c_.family == ModelFamily::kGpt2) {
      Module("transformer.ln_f", -1, {{"weight", {c_.hidden_size}}, {"bias", {c_.hidden_size}}});
    } else {
      Module("model.norm", -1, {{"weight", {c_.hidden_size}}});
    }
    if (!c_.tie_embeddings) {
      Module("lm_head", -1, {{"weight", {c_.vocab_size, c_.hidden_size}}});
      return;
    }
    // Tied: the head reuses the embedding's tensor, so it is that tensor's second name and use.
    ParamRecord& embed = record_.params.front();
    embed.tied_names.push_back("lm_head.weight");
    embed.use_count = 2;
    Compute(
        "lm_head", -1,
        2.0 * static_cast<double>(c_.vocab_size) * static_cast<double>(c_.hidden_size) * tokens_);
  }

  void Timeline() {
    const double rate = c_.matmul_flops;
    std::vector<double> layer_flops(static_cast<size_t>(c_.num_layers), 0.0);
    double t = 0.0;
    int64_t forward_rank = 0;
    for (Segment& seg : segments_) {
      seg.start = t;
      t += seg.flops / rate;
      if (seg.layer >= 0) layer_flops[static_cast<size_t>(seg.layer)] += seg.flops;
      for (size_t p : seg.params) {
        record_.params[p].forward_order = forward_rank++;
        record_.params[p].forward_time = seg.start;
      }
    }
    record_.forward_time = t;
    // Backward: twice the forward FLOPs of each stretch, in reverse. With checkpointing, each
    // decoder layer first reruns its forward (entered at its last stretch).
    int64_t grad_rank = 0;
    for (size_t k = segments_.size(); k-- > 0;) {
      Segment& seg = segments_[k];
      const bool enters_layer =
          seg.layer >= 0 && (k + 1 == segments_.size() || segments_[k + 1].layer != seg.layer);
      if (c_.activation_checkpointing && enters_layer) {
        t += layer_flops[static_cast<size_t>(seg.layer)] / rate;
      }
      t += 2.0 * seg.flops / rate;
      seg.backward_end = t;
      for (size_t p : seg.params) {
        record_.params[p].grad_ready_order = grad_rank++;
        record_.params[p].grad_ready_time = t;
      }
    }
    record_.backward_time = t - record_.forward_time;
  }

  void Memory();

  ProbeRecord Take() { return std::move(record_); }

 private:
  // An embedding table: a gather, not a matmul, so no FLOPs worth counting either way.
  void Gather(const std::string& module, int64_t rows) {
    Module(module, -1, {{"weight", {rows, c_.hidden_size}}});
    segments_.back().flops = 0.0;
  }

  // QK^T and attention-times-V: 2 matmuls of 2*b*s^2*h FLOPs each, causal mask not credited.
  void AttentionCore(const std::string& module, int64_t layer) {
    const double s = static_cast<double>(c_.seq_len);
    Compute(module, layer, 4.0 * tokens_ * s * static_cast<double>(c_.hidden_size));
  }

  void LlamaLayer(int64_t i) {
    const int64_t h = c_.hidden_size;
    const int64_t kv = c_.num_kv_heads * (h / c_.num_heads);
    const std::string pre = LayerPrefix(c_.family, i);
    auto proj = [&](const char* name, int64_t out, bool bias) {
      std::vector<std::pair<const char*, std::vector<int64_t>>> t = {{"weight", {out, h}}};
      if (bias) t.push_back({"bias", {out}});
      Module(pre + ".self_attn." + name, i, std::move(t));
    };
    Module(pre + ".input_layernorm", i, {{"weight", {h}}});
    proj("q_proj", h, c_.attention_bias);
    proj("k_proj", kv, c_.attention_bias);
    proj("v_proj", kv, c_.attention_bias);
    AttentionCore(pre + ".self_attn", i);
    proj("o_proj", h, false);
    Module(pre + ".post_attention_layernorm", i, {{"weight", {h}}});
    Module(pre + ".mlp.gate_proj", i, {{"weight", {c_.intermediate_size, h}}});
    Module(pre + ".mlp.up_proj", i, {{"weight", {c_.intermediate_size, h}}});
    Module(pre + ".mlp.down_proj", i, {{"weight", {h, c_.intermediate_size}}});
  }

  // GPT-2's Conv1D stores its weight as [in, out]; every module has a bias.
  void Gpt2Layer(int64_t i) {
    const int64_t h = c_.hidden_size;
    const int64_t inner = c_.intermediate_size;
    const std::string pre = LayerPrefix(c_.family, i);
    auto conv = [&](const std::string& name, int64_t in, int64_t out) {
      Module(pre + "." + name, i, {{"weight", {in, out}}, {"bias", {out}}});
    };
    Module(pre + ".ln_1", i, {{"weight", {h}}, {"bias", {h}}});
    conv("attn.c_attn", h, 3 * h);
    AttentionCore(pre + ".attn", i);
    conv("attn.c_proj", h, h);
    Module(pre + ".ln_2", i, {{"weight", {h}}, {"bias", {h}}});
    conv("mlp.c_fc", h, inner);
    conv("mlp.c_proj", inner, h);
  }

  void Sample(const std::string& module, const char* event, double time, uint64_t bytes) {
    record_.memory.push_back({module, event, time, bytes});
  }

  const DecoderConfig& c_;
  const double tokens_;
  ProbeRecord record_;
  std::vector<Segment> segments_;
};

// The memory model is the one written out in emsa/analytic_probe.h: parameters resident
// throughout, gradients appearing as they become ready, activations kept per layer (only the
// layer's input with checkpointing), fp32 logits and their gradient around the head.
void Builder::Memory() {
  const uint64_t b = static_cast<uint64_t>(c_.batch);
  const uint64_t s = static_cast<uint64_t>(c_.seq_len);
  const uint64_t h = static_cast<uint64_t>(c_.hidden_size);
  const uint64_t a = static_cast<uint64_t>(c_.num_heads);
  const uint64_t layers = static_cast<uint64_t>(c_.num_layers);
  const uint64_t scores = c_.attention_scores_saved ? 5 * a * s : 0;
  const uint64_t full_layer = (34 * h + scores) * b * s;
  const uint64_t kept_layer = c_.activation_checkpointing ? 2 * h * b * s : full_layer;
  const uint64_t logits = b * s * static_cast<uint64_t>(c_.vocab_size) * 4;
  const uint64_t layers_peak =
      c_.activation_checkpointing ? layers * kept_layer + full_layer : layers * kept_layer;

  uint64_t params = 0;
  for (const ParamRecord& p : record_.params) params += p.bytes;
  record_.peak_device_bytes = params + params + layers_peak + 2 * logits;
  record_.activation_peak_bytes = record_.peak_device_bytes - params;

  // Samples at the boundaries of the embedding, each decoder layer, the final norm and the head.
  struct Span {
    std::string module;
    size_t first, last;  // segment range
  };
  std::vector<Span> spans;
  for (size_t k = 0; k < segments_.size(); ++k) {
    const Segment& seg = segments_[k];
    std::string module = seg.layer >= 0 ? LayerPrefix(c_.family, seg.layer) : seg.module;
    if (!spans.empty() && spans.back().module == module) {
      spans.back().last = k;
    } else {
      spans.push_back({std::move(module), k, k});
    }
  }
  auto end_of = [&](const Span& sp) {
    const Segment& last = segments_[sp.last];
    return last.start + last.flops / c_.matmul_flops;
  };
  uint64_t kept = 0;
  for (const Span& sp : spans) {
    Sample(sp.module, "forward_pre", segments_[sp.first].start, params + kept);
    if (segments_[sp.first].layer >= 0) kept += kept_layer;
    if (sp.module == "lm_head") kept += logits;
    Sample(sp.module, "forward_post", end_of(sp), params + kept);
  }
  uint64_t grads = 0;
  for (size_t k = spans.size(); k-- > 0;) {
    const Span& sp = spans[k];
    for (size_t g = sp.first; g <= sp.last; ++g) {
      for (size_t p : segments_[g].params) grads += record_.params[p].bytes;
    }
    if (segments_[sp.first].layer >= 0) kept -= kept_layer;
    if (sp.module == "lm_head") kept -= logits;
    Sample(sp.module, "backward_post", segments_[sp.first].backward_end, params + grads + kept);
  }
}

}  // namespace

const char* ModelFamilyName(ModelFamily family) {
  switch (family) {
    case ModelFamily::kLlama:
      return "llama";
    case ModelFamily::kGpt2:
      return "gpt2";
  }
  return "unknown";
}

Result<ProbeRecord> AnalyticDecoderProbe(const DecoderConfig& config) {
  EMSA_RETURN_IF_ERROR(CheckConfig(config));
  Builder builder(config);
  builder.Embedding();
  for (int64_t i = 0; i < config.num_layers; ++i) builder.Layer(i);
  builder.Head();
  builder.Timeline();
  builder.Memory();
  ProbeRecord record = builder.Take();
  record.model = config.name;
  record.device = "analytic";
  Status valid = ValidateProbeRecord(record);
  if (!valid.ok())
    return Status::Internal("analytic probe broke its own record: " + valid.message());
  return record;
}

}  // namespace emsa
