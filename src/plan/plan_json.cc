// plan_json.cc — PlanToJson: {"format":"emsa.plan","version":1, ...}, every field of the Plan.
// Keys are written in a fixed order and doubles in shortest round-trip form, so the same plan is
// always the same text.
#include "plan/plan_json.h"

#include <string>

#include "common/json.h"
#include "emsa/plan.h"

namespace emsa {
namespace {

using json::Value;

Value OptionsJson(const PlanOptions& o) {
  Value v = Value::MakeObject();
  v.Set("budget_bytes", o.budget_bytes);
  v.Set("safety_margin_bytes", o.safety_margin_bytes);
  v.Set("optimizer", OptimizerName(o.optimizer));
  v.Set("state_dtype", DTypeName(o.state_dtype));
  v.Set("allow_host_tier", o.allow_host_tier);
  v.Set("force_all_host", o.force_all_host);
  v.Set("bucket_bytes", o.bucket_bytes);
  v.Set("release_grads", o.release_grads);
  v.Set("gated_steps", o.gated_steps);
  v.Set("device_module_alignment", o.device_module_alignment);
  v.Set("device_tensor_alignment", o.device_tensor_alignment);
  v.Set("host_tensor_alignment", o.host_tensor_alignment);
  v.Set("device_update_share", o.device_update_share);
  return v;
}

Value ParamJson(const ParamPlan& p) {
  Value v = Value::MakeObject();
  v.Set("index", p.index);
  v.Set("name", p.name);
  v.Set("module", p.module);
  v.Set("numel", p.numel);
  v.Set("param_dtype", DTypeName(p.param_dtype));
  v.Set("trainable", p.trainable);
  v.Set("tier", TierName(p.tier));
  v.Set("state_dtype", DTypeName(p.state_dtype));
  v.Set("master_weights", p.master_weights);
  v.Set("slack", p.slack);
  v.Set("cost", p.cost);
  v.Set("centrality", p.centrality);
  v.Set("hotness", p.hotness);
  v.Set("offload_rank", p.offload_rank);
  v.Set("bucket", p.bucket);
  v.Set("device_update", p.device_update);
  v.Set("exp_avg_offset", p.exp_avg_offset);
  v.Set("exp_avg_sq_offset", p.exp_avg_sq_offset);
  v.Set("master_offset", p.master_offset);
  v.Set("grad_offset", p.grad_offset);
  v.Set("state_bytes", p.state_bytes);
  return v;
}

Value ModuleJson(const ModuleRange& m) {
  Value v = Value::MakeObject();
  v.Set("module", m.module);
  v.Set("tier", TierName(m.tier));
  v.Set("offset", m.offset);
  v.Set("bytes", m.bytes);
  v.Set("locked_offset", m.locked_offset);
  v.Set("locked_bytes", m.locked_bytes);
  return v;
}

Value BucketJson(const Bucket& b) {
  Value v = Value::MakeObject();
  v.Set("tier", TierName(b.tier));
  v.Set("device_update", b.device_update);
  Value params = Value::MakeArray();
  for (int64_t i : b.params) params.Push(i);
  v.Set("params", std::move(params));
  v.Set("ready_time", b.ready_time);
  v.Set("param_bytes", b.param_bytes);
  return v;
}

Value PredictionJson(const Prediction& p) {
  Value v = Value::MakeObject();
  v.Set("period", p.period);
  v.Set("load_slowdown", p.load_slowdown);
  v.Set("hbm_time", p.hbm_time);
  v.Set("d2h_time", p.d2h_time);
  v.Set("h2d_time", p.h2d_time);
  v.Set("cpu_time", p.cpu_time);
  v.Set("stall_time", p.stall_time);
  v.Set("step_time", p.step_time);
  v.Set("device_state_bytes", p.device_state_bytes);
  v.Set("host_state_bytes", p.host_state_bytes);
  v.Set("host_locked_bytes", p.host_locked_bytes);
  v.Set("peak_device_bytes", p.peak_device_bytes);
  v.Set("device_update_share", p.device_update_share);
  v.Set("stream_staging_bytes", p.stream_staging_bytes);
  return v;
}

// Written element by element (json::ObjectWriter) into `out`; with `emit`, `out` is handed on
// and emptied whenever it holds a mebibyte, and at the end.
void WriteJson(const Plan& plan, std::string* out,
               const std::function<void(std::string_view)>* emit) {
  constexpr size_t kPiece = size_t{1} << 20;
  auto drain = [&](bool last) {
    if (emit == nullptr || (!last && out->size() < kPiece)) return;
    (*emit)(*out);
    out->clear();
  };
  json::ObjectWriter root(out, 2);
  root.Member("format", "emsa.plan");
  root.Member("version", Plan::kVersion);
  root.Member("budget_bytes", plan.budget_bytes);
  root.Member("min_budget_bytes", plan.min_budget_bytes);
  root.Member("options", OptionsJson(plan.options));
  root.Member("prediction", PredictionJson(plan.prediction));
  root.BeginArray("params");
  for (const ParamPlan& p : plan.params) {
    root.Element(ParamJson(p));
    drain(false);
  }
  root.EndArray();
  root.BeginArray("modules");
  for (const ModuleRange& m : plan.modules) {
    root.Element(ModuleJson(m));
    drain(false);
  }
  root.EndArray();
  root.BeginArray("buckets");
  for (const Bucket& b : plan.buckets) {
    root.Element(BucketJson(b));
    drain(false);
  }
  root.EndArray();
  root.Finish();
  out->push_back('\n');
  drain(true);
}

}  // namespace

// The text is reserved up front from the plan's sizes, an estimate above its length, so it is
// not copied as it grows (reserved pages that are never written are never resident).
std::string PlanToJson(const Plan& plan) {
  size_t estimate = 4096 + plan.modules.size() * 256;
  for (const ParamPlan& p : plan.params) estimate += 1024 + 2 * (p.name.size() + p.module.size());
  for (const Bucket& b : plan.buckets) estimate += 512 + 24 * b.params.size();
  std::string out;
  out.reserve(estimate);
  WriteJson(plan, &out, nullptr);
  return out;
}

void WritePlanJson(const Plan& plan, const std::function<void(std::string_view)>& emit) {
  std::string piece;
  WriteJson(plan, &piece, &emit);
}

}  // namespace emsa
