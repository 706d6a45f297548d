// emsa/analytic_probe.h — a ProbeRecord computed from a model's shape instead of measured.
//
// Used for "will it fit, and how fast?" questions without a GPU or weights (`emsa plan --model`,
// with configs from emsa/model_config.h), for tests of the planner on realistic shapes, and for
// the probe records the repo ships as examples. Pure arithmetic: no clocks, no allocation beyond
// the record, the same config always gives the same record.
//
// Families and names (Hugging Face's, so a plan made here names the real model's parameters):
//  - kLlama (LlamaForCausalLM; Mistral and Qwen2 use the same names): model.embed_tokens, then
//    per layer input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
//    mlp.{gate,up,down}_proj (weights only; q/k/v biases with attention_bias, as Qwen2 has),
//    then model.norm and lm_head.
//  - kGpt2 (GPT2LMHeadModel): transformer.wte, transformer.wpe, then per layer
//    transformer.h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}, each with a
//    weight and a bias (Conv1D weights are stored [in, out]), then transformer.ln_f. The head is
//    tied to wte unless tie_embeddings is false. attention_bias is ignored: every GPT-2 linear
//    has a bias.
// A tied head is no tensor of its own: lm_head.weight becomes a tied_names alias of the
// embedding, whose use_count is then 2.
//
// Times: a roofline at matmul_flops. Forward is 2 FLOPs per parameter per token (embeddings,
// being gathers, count none) plus 4*b*s^2*h per layer for attention (QK^T and AV; the causal
// mask is not credited); backward is twice each module's forward, in reverse, plus one more
// forward of each decoder layer with activation checkpointing. A parameter's forward_time is
// its module's start; its grad_ready_time is the end of its module's backward (lm_head first,
// the embedding last, also when tied).
//
// Memory, in bytes; b = batch, s = seq_len, h = hidden_size, a = num_heads, L = num_layers,
// V = vocab_size. Training runs under bf16 autocast, so activations are 16-bit whatever `dtype`
// the parameters have; `dtype` sizes the parameters and their gradients (same dtype).
//   params      = sum of numel * DTypeSize(dtype)
//   grads       = params (every parameter is trainable)
//   full_layer  = (34*h + 5*a*s) * b*s        one layer's saved activations, 16-bit (Korthikanti
//                                             et al., MLSys 2023, eq. 1; no tensor/sequence
//                                             parallelism; the 34 already counts 2 bytes each);
//                                             the 5*a*s term (scores, softmax, dropout mask) only
//                                             with attention_scores_saved: fused attention
//                                             (PyTorch SDPA, FlashAttention) keeps no s x s tensor
//   layers      = L * full_layer                         without checkpointing
//               = L * 2*b*s*h + full_layer               with it: each layer keeps only its
//                                                        16-bit input, and one layer at a time
//                                                        holds its full activations again while
//                                                        it recomputes and runs backward
//   logits      = b*s*V*4                    fp32 logits, and as much again for their gradient
//   peak_device_bytes     = params + grads + layers + 2*logits
//   activation_peak_bytes = peak_device_bytes - params
// The peak is an upper bound on the first step (gradients grow while activations shrink) and the
// actual figure once gradients stay resident (accumulation; zero_grad without set_to_none).
// Memory samples sit at the boundaries of the embedding(s), each decoder layer, the final norm
// and the head.
#pragma once

#include <cstdint>
#include <string>

#include "emsa/probe_record.h"

namespace emsa {

enum class ModelFamily : int32_t {
  kLlama = 0,  // LlamaForCausalLM names: Llama, Mistral, Qwen2 (attention_bias = true)
  kGpt2 = 1,   // GPT2LMHeadModel names
};
const char* ModelFamilyName(ModelFamily family);  // "llama", "gpt2"

struct DecoderConfig {
  // The most decoder layers AnalyticDecoderProbe builds: far past any model (the largest have a
  // few hundred), and few enough that the record and its plan take moments.
  static constexpr int64_t kMaxLayers = 4096;
  std::string name = "decoder";  // becomes ProbeRecord::model
  ModelFamily family = ModelFamily::kLlama;
  int64_t vocab_size = 32000;
  int64_t hidden_size = 2048;
  int64_t intermediate_size = 5632;  // MLP width (GPT-2: n_inner, 4*hidden by default)
  int64_t num_layers = 22;
  int64_t num_heads = 32;
  int64_t num_kv_heads = 4;  // grouped-query attention; = num_heads for plain MHA (GPT-2: must)
  // The context length: the rows of GPT-2's position table (wpe), required there and an upper
  // bound on seq_len; informational for kLlama (0 = unknown).
  int64_t max_position_embeddings = 0;
  bool tie_embeddings = false;
  bool attention_bias = false;    // q/k/v biases (Qwen2 style); kLlama only
  DType dtype = DType::kFloat32;  // the parameters' dtype on the device (param_dtype)
  int64_t batch = 1;
  int64_t seq_len = 2048;
  bool activation_checkpointing = false;
  // Eager attention saves its b*a*s*s scores for backward; fused attention (PyTorch's SDPA,
  // Hugging Face's default, and FlashAttention) does not, so the default counts none.
  bool attention_scores_saved = false;
  double matmul_flops = 400e12;  // FLOP/s the forward/backward reaches (assumed, not peak)
};

// Errors: kInvalidArgument naming the DecoderConfig field (non-positive sizes, hidden_size not
// divisible by num_heads, num_heads not divisible by num_kv_heads, a GPT-2 config with
// num_kv_heads != num_heads or seq_len beyond max_position_embeddings, a non-positive rate, an
// unknown family or dtype, num_layers above kMaxLayers, sizes whose parameters, gradients and
// activations pass ProbeRecord::kMaxBytes).
Result<ProbeRecord> AnalyticDecoderProbe(const DecoderConfig& config);

}  // namespace emsa
