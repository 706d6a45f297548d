// emsa/analytic_probe.h — a ProbeRecord computed from a model's shape instead of measured.
//
// Used for "will it fit, and how fast?" questions without a GPU or weights, for tests of the
// planner on realistic shapes, and for the probe record the repo ships as its example. Timings
// come from a roofline estimate at matmul_flops: forward is 2 FLOPs per parameter per token
// (the embedding, a gather, counts none) plus 4*batch*seq^2*hidden per layer for attention;
// backward is twice each module's forward, in reverse, plus one more forward of each decoder
// layer with activation checkpointing. A parameter's forward_time is its module's start; its
// grad_ready_time is the end of its module's backward (lm_head first, the embedding last, also
// when tied). Memory: parameters, gradients, activations (Korthikanti et al. 2023, 16-bit) and
// fp32 logits with their gradient; peak_device_bytes = params + grads + activation peak;
// samples at the boundaries of the embedding, each decoder layer, norm and lm_head.
// The parameter order follows a Llama-style decoder (Hugging Face LlamaForCausalLM names):
// embed_tokens, then per layer input_layernorm, self_attn.{q,k,v,o}_proj,
// post_attention_layernorm, mlp.{gate,up,down}_proj, then norm and lm_head (absent when tied:
// lm_head.weight becomes a tied_names alias of the embedding, whose use_count is then 2).
#pragma once

#include <cstdint>
#include <string>

#include "emsa/probe_record.h"

namespace emsa {

struct DecoderConfig {
  std::string name = "decoder";
  int64_t vocab_size = 32000;
  int64_t hidden_size = 2048;
  int64_t intermediate_size = 5632;
  int64_t num_layers = 22;
  int64_t num_heads = 32;
  int64_t num_kv_heads = 4;  // grouped-query attention; = num_heads for plain MHA
  bool tie_embeddings = false;
  bool attention_bias = false;    // q/k/v biases (Qwen2 style)
  DType dtype = DType::kFloat32;  // parameter dtype
  int64_t batch = 1;
  int64_t seq_len = 2048;
  bool activation_checkpointing = false;
  double matmul_flops = 400e12;  // FLOP/s the forward/backward reaches (assumed, not peak)
};

// Errors: kInvalidArgument naming the DecoderConfig field (non-positive sizes, hidden_size not
// divisible by num_heads, num_heads not divisible by num_kv_heads, a non-positive rate).
Result<ProbeRecord> AnalyticDecoderProbe(const DecoderConfig& config);

}  // namespace emsa
