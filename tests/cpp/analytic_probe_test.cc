// Tests for AnalyticDecoderProbe: parameter inventory, orders, roofline times, the memory model,
// config errors, and the example records shipped in examples/probes/.
#include "emsa/analytic_probe.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "common/json.h"

namespace emsa {
namespace {

// TinyLlama-1.1B's shape.
DecoderConfig Llama1B() {
  DecoderConfig c;
  c.name = "llama-1.1b";
  c.vocab_size = 32000;
  c.hidden_size = 2048;
  c.intermediate_size = 5632;
  c.num_layers = 22;
  c.num_heads = 32;
  c.num_kv_heads = 4;
  c.batch = 4;
  c.seq_len = 512;
  return c;
}

DecoderConfig TinyGpt() {
  DecoderConfig c;
  c.name = "tiny-gpt";
  c.vocab_size = 1000;
  c.hidden_size = 128;
  c.intermediate_size = 512;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.tie_embeddings = true;
  c.batch = 2;
  c.seq_len = 64;
  return c;
}

ProbeRecord ProbeOrDie(const DecoderConfig& c) {
  Result<ProbeRecord> r = AnalyticDecoderProbe(c);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : ProbeRecord{};
}

const ParamRecord* Find(const ProbeRecord& r, const std::string& name) {
  for (const ParamRecord& p : r.params) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

int64_t TotalNumel(const ProbeRecord& r) {
  int64_t n = 0;
  for (const ParamRecord& p : r.params) n += p.numel;
  return n;
}

uint64_t TotalBytes(const ProbeRecord& r) {
  uint64_t n = 0;
  for (const ParamRecord& p : r.params) n += p.bytes;
  return n;
}

// ---- inventory
// -----------------------------------------------------------------------------------

TEST(AnalyticProbe, Llama1BParameterCount) {
  const ProbeRecord r = ProbeOrDie(Llama1B());
  // embed 32000*2048 + head 32000*2048 + norm 2048 + 22 * (q 2048*2048 + k 2048*256 +
  // v 2048*256 + o 2048*2048 + 3*2048*5632 + 2*2048).
  EXPECT_EQ(TotalNumel(r), 1100048384);
  EXPECT_EQ(TotalBytes(r), 4ull * 1100048384);
  EXPECT_EQ(r.params.size(), 1u + 22 * 9 + 2);
  EXPECT_EQ(r.device, "analytic");
  EXPECT_EQ(r.model, "llama-1.1b");
  EXPECT_TRUE(ValidateProbeRecord(r).ok());
}

TEST(AnalyticProbe, NamesShapesAndModulesFollowHuggingFace) {
  const ProbeRecord r = ProbeOrDie(Llama1B());
  struct Want {
    const char* name;
    std::vector<int64_t> shape;
  };
  const std::vector<Want> head = {
      {"model.embed_tokens.weight", {32000, 2048}},
      {"model.layers.0.input_layernorm.weight", {2048}},
      {"model.layers.0.self_attn.q_proj.weight", {2048, 2048}},
      {"model.layers.0.self_attn.k_proj.weight", {256, 2048}},
      {"model.layers.0.self_attn.v_proj.weight", {256, 2048}},
      {"model.layers.0.self_attn.o_proj.weight", {2048, 2048}},
      {"model.layers.0.post_attention_layernorm.weight", {2048}},
      {"model.layers.0.mlp.gate_proj.weight", {5632, 2048}},
      {"model.layers.0.mlp.up_proj.weight", {5632, 2048}},
      {"model.layers.0.mlp.down_proj.weight", {2048, 5632}},
      {"model.layers.1.input_layernorm.weight", {2048}},
  };
  ASSERT_GE(r.params.size(), head.size());
  for (size_t i = 0; i < head.size(); ++i) {
    EXPECT_EQ(r.params[i].name, head[i].name);
    EXPECT_EQ(r.params[i].shape, head[i].shape) << head[i].name;
  }
  const size_t n = r.params.size();
  EXPECT_EQ(r.params[n - 3].name, "model.layers.21.mlp.down_proj.weight");
  EXPECT_EQ(r.params[n - 2].name, "model.norm.weight");
  EXPECT_EQ(r.params[n - 2].shape, (std::vector<int64_t>{2048}));
  EXPECT_EQ(r.params[n - 1].name, "lm_head.weight");
  EXPECT_EQ(r.params[n - 1].shape, (std::vector<int64_t>{32000, 2048}));
  for (const ParamRecord& p : r.params) {
    EXPECT_EQ(p.module + ".weight", p.name);
    EXPECT_EQ(p.dtype, DType::kFloat32);
    EXPECT_TRUE(p.trainable);
    EXPECT_EQ(p.use_count, 1) << p.name;
    EXPECT_TRUE(p.tied_names.empty()) << p.name;
  }
}

TEST(AnalyticProbe, AttentionBiasesAndDtype) {
  DecoderConfig c = Llama1B();
  c.attention_bias = true;
  c.dtype = DType::kBFloat16;
  const ProbeRecord r = ProbeOrDie(c);
  EXPECT_EQ(TotalNumel(r), 1100048384 + 22 * (2048 + 256 + 256));
  EXPECT_EQ(TotalBytes(r), 2ull * static_cast<uint64_t>(TotalNumel(r)));
  const ParamRecord* kb = Find(r, "model.layers.3.self_attn.k_proj.bias");
  ASSERT_NE(kb, nullptr);
  EXPECT_EQ(kb->shape, (std::vector<int64_t>{256}));
  EXPECT_EQ(kb->module, "model.layers.3.self_attn.k_proj");
  EXPECT_EQ(kb->dtype, DType::kBFloat16);
  EXPECT_EQ(Find(r, "model.layers.3.self_attn.o_proj.bias"), nullptr);
  // The bias follows its weight: same module, next rank.
  const ParamRecord* kw = Find(r, "model.layers.3.self_attn.k_proj.weight");
  ASSERT_NE(kw, nullptr);
  EXPECT_EQ(kb->forward_order, kw->forward_order + 1);
  EXPECT_EQ(kb->grad_ready_time, kw->grad_ready_time);
}

TEST(AnalyticProbe, TiedHeadIsAnAliasOfTheEmbedding) {
  DecoderConfig c = Llama1B();
  c.tie_embeddings = true;
  const ProbeRecord r = ProbeOrDie(c);
  EXPECT_EQ(TotalNumel(r), 1100048384 - 32000 * 2048);
  EXPECT_EQ(r.params.size(), 1u + 22 * 9 + 1);
  EXPECT_EQ(Find(r, "lm_head.weight"), nullptr);
  const ParamRecord& embed = r.params.front();
  EXPECT_EQ(embed.name, "model.embed_tokens.weight");
  EXPECT_EQ(embed.tied_names, (std::vector<std::string>{"lm_head.weight"}));
  EXPECT_EQ(embed.use_count, 2);
  // Its gradient is final only after the embedding's own backward: the very end.
  EXPECT_EQ(embed.grad_ready_order, static_cast<int64_t>(r.params.size()) - 1);
  EXPECT_DOUBLE_EQ(embed.grad_ready_time, r.forward_time + r.backward_time);
  EXPECT_EQ(Find(r, "model.norm.weight")->grad_ready_order, 0);
  // The head's matmul still costs time although it owns no parameter.
  const DecoderConfig untied = Llama1B();
  EXPECT_DOUBLE_EQ(r.forward_time, ProbeOrDie(untied).forward_time);
}

// ---- orders and times
// ----------------------------------------------------------------------------

TEST(AnalyticProbe, EmbeddingIsFirstForwardAndLastBackward) {
  const ProbeRecord r = ProbeOrDie(Llama1B());
  const int64_t n = static_cast<int64_t>(r.params.size());
  const ParamRecord* embed = Find(r, "model.embed_tokens.weight");
  const ParamRecord* head = Find(r, "lm_head.weight");
  EXPECT_EQ(embed->forward_order, 0);
  EXPECT_EQ(embed->forward_time, 0.0);
  EXPECT_EQ(embed->grad_ready_order, n - 1);
  EXPECT_EQ(head->forward_order, n - 1);
  EXPECT_EQ(head->grad_ready_order, 0);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(r.params[i].forward_order, i);

  // Inside a layer backward runs in reverse: down, up, gate, norm, o, v, k, q, norm.
  const char* reverse[] = {
      "mlp.down_proj",    "mlp.up_proj",      "mlp.gate_proj",    "post_attention_layernorm",
      "self_attn.o_proj", "self_attn.v_proj", "self_attn.k_proj", "self_attn.q_proj",
      "input_layernorm"};
  const int64_t first = Find(r, "model.layers.5.mlp.down_proj.weight")->grad_ready_order;
  for (int64_t k = 0; k < 9; ++k) {
    const ParamRecord* p = Find(r, std::string("model.layers.5.") + reverse[k] + ".weight");
    ASSERT_NE(p, nullptr) << reverse[k];
    EXPECT_EQ(p->grad_ready_order, first + k) << reverse[k];
  }
  // Layer 21 finishes its backward before layer 20 starts.
  EXPECT_LT(Find(r, "model.layers.21.input_layernorm.weight")->grad_ready_order,
            Find(r, "model.layers.20.mlp.down_proj.weight")->grad_ready_order);
}

TEST(AnalyticProbe, TimesAreMonotoneInTheirOrders) {
  const ProbeRecord r = ProbeOrDie(Llama1B());
  std::vector<const ParamRecord*> by_grad(r.params.size());
  for (const ParamRecord& p : r.params) by_grad[static_cast<size_t>(p.grad_ready_order)] = &p;
  for (size_t i = 1; i < r.params.size(); ++i) {
    EXPECT_LE(r.params[i - 1].forward_time, r.params[i].forward_time) << r.params[i].name;
    EXPECT_LE(by_grad[i - 1]->grad_ready_time, by_grad[i]->grad_ready_time) << by_grad[i]->name;
    EXPECT_GE(by_grad[i]->grad_ready_time, r.forward_time);
  }
}

// Forward FLOPs: 2 per non-embedding parameter per token, plus 4*b*s^2*h per layer.
double ForwardFlops(const DecoderConfig& c, double params_without_embedding) {
  const double b = static_cast<double>(c.batch), s = static_cast<double>(c.seq_len);
  return 2.0 * params_without_embedding * b * s +
         static_cast<double>(c.num_layers) * 4.0 * b * s * s * static_cast<double>(c.hidden_size);
}

TEST(AnalyticProbe, RooflineTimes) {
  const DecoderConfig c = Llama1B();
  const ProbeRecord r = ProbeOrDie(c);
  const double non_embedding = 1100048384.0 - 32000.0 * 2048.0;
  const double forward = ForwardFlops(c, non_embedding) / c.matmul_flops;
  EXPECT_NEAR(r.forward_time, forward, 1e-12 * forward);
  EXPECT_NEAR(r.backward_time, 2.0 * forward, 1e-12 * forward);
  // The head is the last thing forward and the first thing backward.
  const double head = 2.0 * 32000.0 * 2048.0 * 4 * 512 / c.matmul_flops;
  const ParamRecord* lm = Find(r, "lm_head.weight");
  EXPECT_NEAR(lm->forward_time, forward - head, 1e-12 * forward);
  EXPECT_NEAR(lm->grad_ready_time, forward + 2.0 * head, 1e-12 * forward);
  EXPECT_DOUBLE_EQ(Find(r, "model.embed_tokens.weight")->grad_ready_time,
                   r.forward_time + r.backward_time);
  // Layer 1 starts after the embedding (free) and one full layer.
  const double per_layer =
      (ForwardFlops(c, 0) / 22 +
       2.0 * 4 * 512 * (2.0 * 2048 * 2048 + 2.0 * 256 * 2048 + 3.0 * 2048 * 5632 + 2.0 * 2048)) /
      c.matmul_flops;
  EXPECT_NEAR(Find(r, "model.layers.1.input_layernorm.weight")->forward_time, per_layer,
              1e-12 * forward);
}

TEST(AnalyticProbe, CheckpointingAddsOneForwardOfEachLayerToBackward) {
  DecoderConfig c = Llama1B();
  const ProbeRecord plain = ProbeOrDie(c);
  c.activation_checkpointing = true;
  const ProbeRecord ckpt = ProbeOrDie(c);
  const double head = 2.0 * 32000.0 * 2048.0 * 4 * 512 / c.matmul_flops;
  const double layers = plain.forward_time - head - 2.0 * 2048 * 4 * 512 / c.matmul_flops;
  EXPECT_DOUBLE_EQ(ckpt.forward_time, plain.forward_time);
  EXPECT_NEAR(ckpt.backward_time, plain.backward_time + layers, 1e-12 * plain.forward_time);
  EXPECT_LT(ckpt.peak_device_bytes, plain.peak_device_bytes);
}

// ---- memory
// --------------------------------------------------------------------------------------

TEST(AnalyticProbe, PeakMemoryModel) {
  for (int variant = 0; variant < 4; ++variant) {
    const bool checkpointing = variant & 1, eager = variant & 2;
    SCOPED_TRACE(std::string(checkpointing ? "checkpointing" : "no checkpointing") +
                 (eager ? ", eager attention" : ", fused attention"));
    DecoderConfig c = Llama1B();
    c.activation_checkpointing = checkpointing;
    c.attention_scores_saved = eager;
    const ProbeRecord r = ProbeOrDie(c);
    const uint64_t params = 4ull * 1100048384;
    const uint64_t b = 4, s = 512, h = 2048, a = 32, v = 32000, l = 22;
    // Korthikanti et al., bytes; the scores' 5*a*s only where eager attention saves them.
    const uint64_t full_layer = (34 * h + (eager ? 5 * a * s : 0)) * b * s;
    const uint64_t layers = checkpointing ? l * 2 * h * b * s + full_layer : l * full_layer;
    const uint64_t logits = b * s * v * 4;
    EXPECT_EQ(r.peak_device_bytes, params + params + layers + 2 * logits);
    EXPECT_EQ(r.activation_peak_bytes, r.peak_device_bytes - params);
  }
}

TEST(AnalyticProbe, MemorySamplesFollowTheModel) {
  const DecoderConfig c = Llama1B();
  const ProbeRecord r = ProbeOrDie(c);
  const uint64_t params = 4ull * 1100048384;
  const uint64_t full_layer = 34ull * 2048 * 4 * 512;  // fused attention: no scores saved
  const uint64_t logits = 4ull * 512 * 32000 * 4;
  // Embedding, 22 layers, norm, head: pre and post forward, post backward.
  ASSERT_EQ(r.memory.size(), 3u * 25);
  EXPECT_EQ(r.memory[0].module, "model.embed_tokens");
  EXPECT_EQ(r.memory[0].event, "forward_pre");
  EXPECT_EQ(r.memory[0].device_bytes, params);
  for (int i = 0; i < 22; ++i) {
    const MemorySample& pre = r.memory[2 + 2 * i];
    const MemorySample& post = r.memory[3 + 2 * i];
    EXPECT_EQ(pre.module, "model.layers." + std::to_string(i));
    EXPECT_EQ(pre.event, "forward_pre");
    EXPECT_EQ(post.event, "forward_post");
    EXPECT_EQ(pre.device_bytes, params + i * full_layer);
    EXPECT_EQ(post.device_bytes, params + (i + 1) * full_layer);
    EXPECT_LT(pre.time, post.time);
  }
  const MemorySample& head_post = r.memory[2 * 25 - 1];
  EXPECT_EQ(head_post.module, "lm_head");
  EXPECT_EQ(head_post.device_bytes, params + 22 * full_layer + logits);
  EXPECT_DOUBLE_EQ(head_post.time, r.forward_time);
  // Backward: the head first, the embedding last, with every gradient then resident.
  EXPECT_EQ(r.memory[2 * 25].module, "lm_head");
  EXPECT_EQ(r.memory[2 * 25].event, "backward_post");
  EXPECT_EQ(r.memory[2 * 25].device_bytes, params + 4ull * 32000 * 2048 + 22 * full_layer);
  const MemorySample& last = r.memory.back();
  EXPECT_EQ(last.module, "model.embed_tokens");
  EXPECT_EQ(last.device_bytes, 2 * params);
  EXPECT_DOUBLE_EQ(last.time, r.forward_time + r.backward_time);
  for (size_t i = 1; i < r.memory.size(); ++i) {
    EXPECT_LE(r.memory[i - 1].time, r.memory[i].time);
    EXPECT_LE(r.memory[i].device_bytes, r.peak_device_bytes);
  }
}

// ---- config errors
// -------------------------------------------------------------------------------

TEST(AnalyticProbe, NonsenseConfigsNameTheField) {
  struct Case {
    std::function<void(DecoderConfig&)> edit;
    const char* field;
  };
  const std::vector<Case> cases = {
      {[](DecoderConfig& c) { c.vocab_size = 0; }, "vocab_size"},
      {[](DecoderConfig& c) { c.hidden_size = -1; }, "hidden_size"},
      {[](DecoderConfig& c) { c.intermediate_size = 0; }, "intermediate_size"},
      {[](DecoderConfig& c) { c.num_layers = 0; }, "num_layers"},
      {[](DecoderConfig& c) { c.num_heads = 0; }, "num_heads"},
      {[](DecoderConfig& c) { c.num_kv_heads = -4; }, "num_kv_heads"},
      {[](DecoderConfig& c) { c.batch = 0; }, "batch"},
      {[](DecoderConfig& c) { c.seq_len = 0; }, "seq_len"},
      {[](DecoderConfig& c) { c.num_heads = 30; },
       "hidden_size 2048 is not divisible by num_heads"},
      {[](DecoderConfig& c) { c.num_kv_heads = 5; },
       "num_heads 32 is not divisible by num_kv_heads"},
      {[](DecoderConfig& c) { c.matmul_flops = 0; }, "matmul_flops"},
      {[](DecoderConfig& c) { c.vocab_size = int64_t{1} << 50; }, "2^50"},
      {[](DecoderConfig& c) { c.num_layers = DecoderConfig::kMaxLayers + 1; },
       "num_layers: 4097 exceeds the limit 4096"},
      {[](DecoderConfig& c) { c.batch = int64_t{1} << 40; }, "2^50"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.field);
    DecoderConfig c = Llama1B();
    k.edit(c);
    Result<ProbeRecord> r = AnalyticDecoderProbe(c);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(k.field), std::string::npos) << r.status().ToString();
  }
}

// ---- the shipped examples
// ------------------------------------------------------------------------

// The files in examples/probes/ are this generator's output. The test regenerates each in memory
// and compares bytes, so the shipped files can never drift from the code. After a deliberate
// change, rewrite them with:
//   EMSA_REGENERATE_EXAMPLES=1 ./build/tests/emsa_tests --gtest_filter='AnalyticProbeExamples.*'
void CheckExample(const DecoderConfig& config, const std::string& file) {
  const std::string path = std::string(EMSA_SOURCE_DIR) + "/examples/probes/" + file;
  const std::string text = ProbeRecordToJson(ProbeOrDie(config));
  const char* regenerate = std::getenv("EMSA_REGENERATE_EXAMPLES");
  if (regenerate != nullptr && std::string(regenerate) == "1") {
    ASSERT_TRUE(json::WriteFile(path, text).ok()) << path;
  }
  Result<std::string> shipped = json::ReadFile(path);
  ASSERT_TRUE(shipped.ok()) << shipped.status().ToString()
                            << "\n(create it with EMSA_REGENERATE_EXAMPLES=1)";
  EXPECT_TRUE(*shipped == text) << path
                                << " differs from AnalyticDecoderProbe's output; if the change is "
                                   "intended, rerun this test with EMSA_REGENERATE_EXAMPLES=1";
  Result<ProbeRecord> loaded = LoadProbeRecord(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(ProbeRecordToJson(*loaded), text);
}

TEST(AnalyticProbeExamples, Llama1B) {
  CheckExample(Llama1B(), "llama-1.1b.json");
  const ProbeRecord r = ProbeOrDie(Llama1B());
  EXPECT_FALSE(r.has_profile);
  EXPECT_EQ(r.params.back().name, "lm_head.weight");
}

TEST(AnalyticProbeExamples, TinyGpt) {
  CheckExample(TinyGpt(), "tiny-gpt.json");
  const ProbeRecord r = ProbeOrDie(TinyGpt());
  EXPECT_EQ(r.params.size(), 1u + 2 * 9 + 1);
  EXPECT_EQ(r.params[0].use_count, 2);
}

}  // namespace
}  // namespace emsa
