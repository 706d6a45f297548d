// Tests for the planner: hotness order on decoder shapes, budgets (sweeps, exact minimum,
// defaults), layout invariants, buckets, the predicted timeline, JSON and table output.
#include "emsa/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/json.h"
#include "emsa/analytic_probe.h"
#include "emsa/host_arena.h"

namespace emsa {
namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;

ProbeRecord Decoder(bool tied, DType dtype = DType::kFloat32, int64_t layers = 4) {
  DecoderConfig c;
  c.vocab_size = 4000;
  c.hidden_size = 256;
  c.intermediate_size = 704;
  c.num_layers = layers;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.seq_len = 128;
  c.tie_embeddings = tied;
  c.dtype = dtype;
  Result<ProbeRecord> r = AnalyticDecoderProbe(c);
  if (!r.ok()) ADD_FAILURE() << r.status().ToString();
  return r.ok() ? std::move(r).value() : ProbeRecord{};
}

DeviceProfile Gpu(uint64_t free_memory = 80 * kGiB) {
  DeviceProfile p;
  p.gpu.present = true;
  p.gpu.total_memory = 80 * kGiB;
  p.gpu.free_memory = free_memory;
  p.gpu.hbm_bandwidth = 1e12;
  p.gpu.d2h_bandwidth = 10e9;
  p.gpu.h2d_bandwidth = 10e9;
  p.cpu.host_update_bandwidth = 20e9;
  return p;
}

ParamRecord Param(const std::string& name, const std::string& module, int64_t numel, int64_t order,
                  double forward_time, int64_t grad_order, double grad_time,
                  DType dtype = DType::kFloat32) {
  ParamRecord p;
  p.name = name;
  p.module = module;
  p.shape = {numel};
  p.numel = numel;
  p.dtype = dtype;
  p.bytes = static_cast<uint64_t>(numel) * DTypeSize(dtype);
  p.forward_order = order;
  p.forward_time = forward_time;
  p.grad_ready_order = grad_order;
  p.grad_ready_time = grad_time;
  return p;
}

Plan MustPlan(const ProbeRecord& r, const DeviceProfile& profile, const PlanOptions& o) {
  Result<Plan> plan = MakePlan(r, profile, o);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  return plan.ok() ? std::move(plan).value() : Plan{};
}

const ParamPlan& Find(const Plan& plan, const std::string& name) {
  for (const ParamPlan& p : plan.params) {
    if (p.name == name) return p;
  }
  ADD_FAILURE() << "no param " << name;
  return plan.params.front();
}

std::set<int64_t> HostSet(const Plan& plan) {
  std::set<int64_t> host;
  for (const ParamPlan& p : plan.params) {
    if (p.trainable && p.tier == Tier::kL2) host.insert(p.index);
  }
  return host;
}

uint64_t BaseBytes(const ProbeRecord& r) {
  uint64_t sum = 0;
  for (const ParamRecord& p : r.params) sum += p.bytes * (p.trainable ? 2 : 1);
  return std::max(sum, r.peak_device_bytes);
}

// Every view at its alignment, inside its arena, inside its module's range, no two overlapping;
// view sizes recomputed here from the rules in plan.h, not taken from the planner.
void CheckLayout(const Plan& plan) {
  const PlanOptions& o = plan.options;
  struct Span {
    uint64_t begin, end;
    std::string what;
  };
  std::vector<Span> spans[2];
  std::map<std::pair<std::string, int>, const ModuleRange*> ranges;
  for (const ModuleRange& m : plan.modules) {
    EXPECT_TRUE(ranges.emplace(std::make_pair(m.module, static_cast<int>(m.tier)), &m).second)
        << m.module << " has two ranges in one tier";
    if (m.tier == Tier::kL1 && m.bytes >= o.device_module_alignment) {
      EXPECT_EQ(m.offset % o.device_module_alignment, 0u) << m.module;
    }
    spans[m.tier == Tier::kL2].push_back({m.offset, m.offset + m.bytes, "module " + m.module});
    if (m.tier == Tier::kL1) {
      EXPECT_EQ(m.locked_bytes, 0u) << m.module;
    } else {  // the module's copied views, in the arena's locked prefix
      EXPECT_LE(m.locked_offset + m.locked_bytes, plan.prediction.host_locked_bytes) << m.module;
      spans[1].push_back(
          {m.locked_offset, m.locked_offset + m.locked_bytes, "locked part of module " + m.module});
    }
  }
  for (auto& s : spans) {  // module ranges do not overlap
    // By begin, then end: an empty view at the offset where another begins overlaps nothing,
    // and std::sort leaves the order of equal keys to the library (libc++ and libstdc++ differ).
    std::sort(s.begin(), s.end(), [](const Span& a, const Span& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    for (size_t i = 1; i < s.size(); ++i) {
      EXPECT_LE(s[i - 1].end, s[i].begin) << s[i - 1].what << " overlaps " << s[i].what;
    }
    s.clear();
  }
  std::map<std::pair<std::string, int>, uint64_t> module_sums;
  const uint64_t arena[2] = {plan.prediction.device_state_bytes, plan.prediction.host_state_bytes};
  for (const ParamPlan& p : plan.params) {
    if (!p.trainable) {
      EXPECT_EQ(p.state_bytes, 0u);
      EXPECT_EQ(p.bucket, -1);
      EXPECT_EQ(p.offload_rank, -1);
      for (int64_t off : {p.exp_avg_offset, p.exp_avg_sq_offset, p.master_offset, p.grad_offset}) {
        EXPECT_EQ(off, -1) << p.name;
      }
      continue;
    }
    const bool host = p.tier == Tier::kL2;
    EXPECT_TRUE(p.tier == Tier::kL1 || host) << p.name;
    const uint64_t align = host ? o.host_tensor_alignment : o.device_tensor_alignment;
    const uint64_t n = static_cast<uint64_t>(p.numel);
    const uint64_t state = n * DTypeSize(o.state_dtype);
    const uint64_t param = n * DTypeSize(p.param_dtype);
    const bool fp32 = p.param_dtype == DType::kFloat32;
    const bool lion = o.optimizer == OptimizerKind::kLion;
    // {offset, size, whether a copy to or from the device touches it (host tier)}: the
    // gradient staging (a 16-bit param is rounded over it), an fp32 master, a GPU-updated
    // param's moments.
    const std::tuple<int64_t, int64_t, bool> views[] = {
        {p.exp_avg_offset, static_cast<int64_t>(state), p.device_update},
        {p.exp_avg_sq_offset, lion ? -1 : static_cast<int64_t>(state), p.device_update},
        {p.master_offset, host || !fp32 ? static_cast<int64_t>(n * 4) : -1, fp32},
        {p.grad_offset, host ? static_cast<int64_t>(param) : -1, true}};
    EXPECT_EQ(p.master_weights, host || !fp32) << p.name;
    uint64_t used = 0;
    auto it = ranges.find({p.module, static_cast<int>(p.tier)});
    EXPECT_NE(it, ranges.end()) << p.name << " has no module range";
    for (const auto& [offset, size, copied] : views) {
      if (size < 0) {
        EXPECT_EQ(offset, -1) << p.name << " has a view it should not";
        continue;
      }
      EXPECT_GE(offset, 0) << p.name << " lacks a view";
      if (offset < 0) continue;
      const uint64_t begin = static_cast<uint64_t>(offset);
      const uint64_t end = begin + static_cast<uint64_t>(size);
      EXPECT_EQ(begin % align, 0u) << p.name;
      EXPECT_LE(end, arena[host]) << p.name;
      // Host tier: what copies touch lies in the locked prefix, the rest after it.
      const bool locked = host && copied;
      if (host) {
        EXPECT_TRUE(locked ? end <= plan.prediction.host_locked_bytes
                           : begin >= plan.prediction.host_locked_bytes)
            << p.name << " at " << begin;
      }
      if (it != ranges.end()) {
        const uint64_t lo = locked ? it->second->locked_offset : it->second->offset;
        const uint64_t bytes = locked ? it->second->locked_bytes : it->second->bytes;
        EXPECT_GE(begin, lo) << p.name;
        EXPECT_LE(end, lo + bytes) << p.name;
      }
      spans[host].push_back({begin, end, p.name});
      used += static_cast<uint64_t>(size);
    }
    EXPECT_GE(p.state_bytes, used) << p.name;
    EXPECT_LT(p.state_bytes, used + 5 * align) << p.name;
    module_sums[{p.module, static_cast<int>(p.tier)}] += p.state_bytes;
  }
  for (const auto& [key, range] : ranges) {
    EXPECT_EQ(module_sums[key], range->bytes + range->locked_bytes) << key.first;
  }
  const uint64_t locked = plan.prediction.host_locked_bytes;
  EXPECT_LE(locked, plan.prediction.host_state_bytes);
  if (locked < plan.prediction.host_state_bytes) EXPECT_EQ(locked % kHostArenaPageBytes, 0u);
  for (auto& s : spans) {
    // By begin, then end: an empty view at the offset where another begins overlaps nothing,
    // and std::sort leaves the order of equal keys to the library (libc++ and libstdc++ differ).
    std::sort(s.begin(), s.end(), [](const Span& a, const Span& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    for (size_t i = 1; i < s.size(); ++i) {
      EXPECT_LE(s[i - 1].end, s[i].begin) << s[i - 1].what << " overlaps " << s[i].what;
    }
  }
  EXPECT_EQ(plan.prediction.device_state_bytes % o.device_module_alignment, 0u);
}

// Buckets: one tier each, gradient-ready order, within bucket_bytes unless alone, every
// trainable param in exactly one.
void CheckBuckets(const ProbeRecord& r, const Plan& plan) {
  std::vector<int> seen(plan.params.size(), 0);
  int64_t last_order = -1;
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const Bucket& bucket = plan.buckets[b];
    ASSERT_FALSE(bucket.params.empty());
    uint64_t bytes = 0;
    double ready = 0.0;
    for (int64_t i : bucket.params) {
      const ParamPlan& p = plan.params[static_cast<size_t>(i)];
      EXPECT_EQ(p.tier, bucket.tier);
      EXPECT_EQ(p.bucket, static_cast<int64_t>(b));
      const int64_t order = r.params[static_cast<size_t>(i)].grad_ready_order;
      if (order >= 0) {  // params without a gradient come last, in index order
        EXPECT_GT(order, last_order) << p.name;
        last_order = order;
      }
      bytes += r.params[static_cast<size_t>(i)].bytes;
      ready = r.params[static_cast<size_t>(i)].grad_ready_time;
      ++seen[static_cast<size_t>(i)];
    }
    EXPECT_EQ(bucket.param_bytes, bytes);
    EXPECT_EQ(bucket.ready_time, ready);
    if (bucket.params.size() > 1) EXPECT_LE(bytes, plan.options.bucket_bytes);
    if (b > 0 && plan.buckets[b - 1].tier == bucket.tier) {  // cut only because it was full
      const uint64_t first = r.params[static_cast<size_t>(bucket.params[0])].bytes;
      EXPECT_GT(plan.buckets[b - 1].param_bytes + first, plan.options.bucket_bytes);
    }
  }
  for (const ParamPlan& p : plan.params) {
    EXPECT_EQ(seen[static_cast<size_t>(p.index)], p.trainable ? 1 : 0) << p.name;
  }
}

// ---- hotness --------------------------------------------------------------------------------

TEST(PlanHotness, UntiedDecoderEmbeddingHottestHeadColdest) {
  const ProbeRecord r = Decoder(false);
  const Plan plan = MustPlan(r, DeviceProfile{}, PlanOptions{});
  const ParamPlan& embed = Find(plan, "model.embed_tokens.weight");
  const ParamPlan& head = Find(plan, "lm_head.weight");
  const int64_t n = static_cast<int64_t>(plan.params.size());
  EXPECT_EQ(embed.offload_rank, n - 1);
  EXPECT_EQ(head.offload_rank, 0);
  for (const ParamPlan& p : plan.params) {
    EXPECT_LE(p.hotness, embed.hotness) << p.name;
    EXPECT_LE(p.slack, head.slack) << p.name;
    EXPECT_GE(p.slack, embed.slack) << p.name;
    EXPECT_GT(p.cost, 0.0) << p.name;
  }
  // Later layers leave the device before earlier ones: the last layer's MLP before the first's.
  EXPECT_LT(Find(plan, "model.layers.3.mlp.down_proj.weight").offload_rank,
            Find(plan, "model.layers.0.mlp.down_proj.weight").offload_rank);
}

TEST(PlanHotness, TiedEmbeddingIsHottestAndHeadIsNotSeparate) {
  const ProbeRecord r = Decoder(true);
  const Plan plan = MustPlan(r, DeviceProfile{}, PlanOptions{});
  for (const ParamPlan& p : plan.params) EXPECT_NE(p.name, "lm_head.weight");
  const ParamPlan& embed = Find(plan, "model.embed_tokens.weight");
  EXPECT_EQ(embed.offload_rank, static_cast<int64_t>(plan.params.size()) - 1);
  for (const ParamPlan& p : plan.params) EXPECT_LE(p.hotness, embed.hotness) << p.name;
}

TEST(PlanHotness, SlackCostAndHotnessFollowTheModel) {
  ProbeRecord r;
  r.forward_time = 0.01;
  r.backward_time = 0.02;
  r.params = {Param("a", "m", 1000, 0, 0.002, 1, 0.025), Param("b", "m", 500, 1, 0.004, 0, 0.02)};
  const DeviceProfile profile = Gpu();
  const Plan plan = MustPlan(r, profile, PlanOptions{});
  // AdamW fp32: 4 B down, 4 B up per element; host memory moves the CPU's 24 B (the update
  // applied on the device from a delta) and the DMA's 8.
  const double per_element = 4 / 10e9 + 32 / 20e9 + 4 / 10e9;
  EXPECT_NEAR(plan.params[0].slack, 0.03 + 0.002 - 0.025, 1e-15);
  EXPECT_NEAR(plan.params[1].slack, 0.03 + 0.004 - 0.02, 1e-15);
  EXPECT_DOUBLE_EQ(plan.params[0].cost, 1000 * per_element);
  EXPECT_DOUBLE_EQ(plan.params[1].cost, 500 * per_element);
  EXPECT_DOUBLE_EQ(plan.params[0].hotness, plan.params[0].cost / plan.params[0].slack);
  EXPECT_EQ(plan.params[0].centrality, 0.0);
}

TEST(PlanHotness, GraphCentralityReordersEqualParams) {
  ProbeRecord r;
  r.forward_time = 0.01;
  r.backward_time = 0.02;
  r.params = {Param("a", "ma", 1000, 0, 0.001, 0, 0.02), Param("b", "mb", 1000, 1, 0.001, 1, 0.02)};
  // Without a graph the two tie, and the lower index leaves the device first.
  const Plan flat = MustPlan(r, Gpu(), PlanOptions{});
  EXPECT_EQ(flat.params[0].hotness, flat.params[1].hotness);
  EXPECT_EQ(flat.params[0].offload_rank, 0);
  // "a" feeds every op; "b" only the last: a is central, so hotter, so b leaves first.
  r.graph = {{"op0", {"a"}, {}}, {"op1", {}, {0}}, {"op2", {}, {1}}, {"op3", {"b"}, {2}}};
  const Plan graph = MustPlan(r, Gpu(), PlanOptions{});
  EXPECT_DOUBLE_EQ(graph.params[0].centrality, 1.0);
  EXPECT_DOUBLE_EQ(graph.params[1].centrality, 0.25);
  EXPECT_DOUBLE_EQ(graph.params[0].hotness, 2.0 * flat.params[0].hotness);
  EXPECT_DOUBLE_EQ(graph.params[1].hotness, 1.25 * flat.params[1].hotness);
  EXPECT_EQ(graph.params[1].offload_rank, 0);
  EXPECT_EQ(graph.params[0].offload_rank, 1);
}

TEST(PlanHotness, CentralityCountsAliasesAndBranches) {
  ProbeRecord r;
  r.forward_time = 0.01;
  r.backward_time = 0.02;
  r.params = {Param("e", "e", 10, 0, 0.0, 1, 0.03), Param("w", "w", 10, 1, 0.001, 0, 0.02)};
  r.params[0].tied_names = {"head"};
  // 70 ops (more than one 64-op block): e feeds op0, which starts a chain of 60; w feeds op61,
  // a side branch of 9 ops; "head" (e's alias) reads the last op.
  for (int i = 0; i < 70; ++i) {
    GraphOp op;
    op.name = "op" + std::to_string(i);
    if (i == 0) op.params = {"e"};
    if (i > 0 && i <= 60) op.inputs = {i - 1};
    if (i == 61) op.params = {"w"};
    if (i > 61) op.inputs = {i - 1};
    if (i == 69) op.params = {"head"};
    r.graph.push_back(op);
  }
  const Plan plan = MustPlan(r, Gpu(), PlanOptions{});
  EXPECT_DOUBLE_EQ(plan.params[0].centrality, 62.0 / 70.0);  // op0..op60 and op69
  EXPECT_DOUBLE_EQ(plan.params[1].centrality, 9.0 / 70.0);   // op61..op69
}

// ---- budgets --------------------------------------------------------------------------------

TEST(PlanBudget, SweepNeverExceedsBudgetAndMoreBudgetNeverMovesMoreToHost) {
  for (uint64_t module_alignment : {uint64_t{4096}, 2 * kMiB}) {
    const ProbeRecord r = Decoder(false);
    PlanOptions o;
    o.device_update_share = 0;  // the CPU updates the host tier: no device staging

    o.device_module_alignment = module_alignment;
    const Plan unlimited = MustPlan(r, DeviceProfile{}, o);
    EXPECT_TRUE(HostSet(unlimited).empty());
    const uint64_t min = unlimited.min_budget_bytes;
    const uint64_t all_fit = unlimited.prediction.peak_device_bytes;
    ASSERT_LT(min, all_fit);
    EXPECT_EQ(min, BaseBytes(r));  // everything can go to the host
    std::set<int64_t> previous;
    std::map<size_t, uint64_t> peak_by_host_count;
    std::vector<std::pair<uint64_t, Plan>> plans;
    const uint64_t steps = 200;
    for (uint64_t s = 0; s <= steps; ++s) {
      o.budget_bytes = min + (all_fit - min) * s / steps;
      Plan plan = MustPlan(r, Gpu(), o);
      EXPECT_LE(plan.prediction.peak_device_bytes, o.budget_bytes);
      EXPECT_EQ(plan.budget_bytes, o.budget_bytes);
      const std::set<int64_t> host = HostSet(plan);
      if (s > 0)
        EXPECT_TRUE(std::includes(previous.begin(), previous.end(), host.begin(), host.end()))
            << "budget " << o.budget_bytes << " moved a param to the host that less budget kept";
      // The host set is always the coldest ranks: {rank < k}.
      for (const ParamPlan& p : plan.params)
        EXPECT_EQ(p.offload_rank < (int64_t)host.size(), host.count(p.index) == 1);
      peak_by_host_count[host.size()] = plan.prediction.peak_device_bytes;
      previous = host;
      plans.emplace_back(o.budget_bytes, std::move(plan));
    }
    EXPECT_TRUE(previous.empty());  // at all_fit nothing is on the host
    EXPECT_GT(peak_by_host_count.size(), 10u);
    // Minimal: no plan with fewer params on the host would have fit the same budget.
    for (const auto& [budget, plan] : plans) {
      const size_t k = HostSet(plan).size();
      for (const auto& [other_k, peak] : peak_by_host_count) {
        if (other_k < k) EXPECT_GT(peak, budget) << "k=" << k << " but " << other_k << " fits";
      }
      CheckLayout(plan);
    }
  }
}

TEST(PlanBudget, InfeasibleReportsExactMinimum) {
  const ProbeRecord r = Decoder(false);
  for (bool allow_host : {true, false}) {
    PlanOptions o;
    o.device_update_share = 0;  // the CPU updates the host tier: no device staging

    o.allow_host_tier = allow_host;
    const Plan unlimited = MustPlan(r, DeviceProfile{}, o);
    const uint64_t min = unlimited.min_budget_bytes;
    EXPECT_EQ(min, allow_host ? BaseBytes(r) : unlimited.prediction.peak_device_bytes);

    o.budget_bytes = min;
    uint64_t reported = 0;
    Result<Plan> at = MakePlan(r, Gpu(), o, &reported);
    ASSERT_TRUE(at.ok()) << at.status().ToString();
    EXPECT_EQ(reported, min);
    EXPECT_LE(at->prediction.peak_device_bytes, min);

    o.budget_bytes = min - 1;
    reported = 0;
    Result<Plan> below = MakePlan(r, Gpu(), o, &reported);
    ASSERT_FALSE(below.ok());
    EXPECT_EQ(below.status().code(), StatusCode::kInfeasible);
    EXPECT_EQ(reported, min);
    const std::string& msg = below.status().message();
    EXPECT_NE(msg.find(FormatBytes(min)), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(min) + " bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find(allow_host ? "activation" : "allow the host tier"), std::string::npos)
        << msg;
  }
}

TEST(PlanBudget, DefaultBudgetComesFromTheProfile) {
  const ProbeRecord r = Decoder(false);
  PlanOptions o;
  o.safety_margin_bytes = 1 * kGiB;
  EXPECT_EQ(MustPlan(r, Gpu(10 * kGiB), o).budget_bytes, 9 * kGiB);
  DeviceProfile total_only = Gpu(0);
  EXPECT_EQ(MustPlan(r, total_only, o).budget_bytes, 79 * kGiB);
  EXPECT_EQ(MustPlan(r, DeviceProfile{}, o).budget_bytes, 0u);  // no GPU: no limit

  Result<Plan> starved = MakePlan(r, Gpu(kGiB / 2), o);
  ASSERT_FALSE(starved.ok());
  EXPECT_EQ(starved.status().code(), StatusCode::kInfeasible);
  EXPECT_NE(starved.status().message().find("safety margin"), std::string::npos);
}

TEST(PlanBudget, ForceAllHostAndNoHostTier) {
  const ProbeRecord r = Decoder(false, DType::kBFloat16);
  PlanOptions o;
  o.force_all_host = true;
  const Plan all_host = MustPlan(r, Gpu(), o);
  EXPECT_EQ(HostSet(all_host).size(), r.params.size());
  EXPECT_EQ(all_host.prediction.device_state_bytes, 0u);
  EXPECT_GT(all_host.prediction.host_state_bytes, 0u);
  CheckLayout(all_host);

  o.force_all_host = false;
  o.allow_host_tier = false;
  o.budget_bytes = 1;
  uint64_t min = 0;
  Result<Plan> plan = MakePlan(r, Gpu(), o, &min);
  ASSERT_FALSE(plan.ok());
  o.budget_bytes = min;
  const Plan device_only = MustPlan(r, Gpu(), o);
  EXPECT_TRUE(HostSet(device_only).empty());
  CheckLayout(device_only);
}

// ---- state and layout -----------------------------------------------------------------------

TEST(PlanState, OptimizersAndDtypesGetTheirViews) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kLion}) {
      for (DType state : {DType::kFloat32, DType::kBFloat16}) {
        const ProbeRecord r = Decoder(false, dtype);
        PlanOptions o;
        o.device_update_share = 0;  // the CPU updates the host tier: no device staging

        o.optimizer = kind;
        o.state_dtype = state;
        o.device_module_alignment = 64 * 1024;
        const Plan unlimited = MustPlan(r, DeviceProfile{}, o);
        o.budget_bytes = (unlimited.min_budget_bytes + unlimited.prediction.peak_device_bytes) / 2;
        const Plan plan = MustPlan(r, Gpu(), o);
        SCOPED_TRACE(std::string(DTypeName(dtype)) + " " + OptimizerName(kind) + " " +
                     DTypeName(state));
        EXPECT_FALSE(HostSet(plan).empty());
        EXPECT_LT(HostSet(plan).size(), r.params.size());
        for (const ParamPlan& p : plan.params) {
          EXPECT_EQ(p.state_dtype, state);
          EXPECT_EQ(p.exp_avg_sq_offset >= 0, kind != OptimizerKind::kLion) << p.name;
        }
        CheckLayout(plan);
        CheckBuckets(r, plan);
      }
    }
  }
}

TEST(PlanState, FrozenParamsHoldMemoryButGetNoState) {
  ProbeRecord r;
  r.forward_time = 0.01;
  r.backward_time = 0.02;
  r.params = {Param("frozen", "a", 1000, 0, 0.0, -1, 0.0),
              Param("w", "b", 1000, 1, 0.005, 0, 0.02)};
  r.params[0].trainable = false;
  const Plan plan = MustPlan(r, Gpu(), PlanOptions{});
  EXPECT_EQ(plan.min_budget_bytes, 4000u + 8000u);  // frozen weights + trainable weights + grad
  // Gradients released in backward: with "w" on the host, the staging the GPU updates it
  // through (3 slots of its 1000 elements, two fp32 moments each) is in the minimum.
  PlanOptions released;
  released.release_grads = true;
  const Plan in_backward = MustPlan(r, Gpu(), released);
  EXPECT_EQ(in_backward.min_budget_bytes, 4000u + 8000u + 3u * 1000u * 8u);
  EXPECT_EQ(plan.params[0].state_bytes, 0u);
  EXPECT_GT(plan.params[1].state_bytes, 0u);
  EXPECT_EQ(plan.buckets.size(), 1u);
  for (const ModuleRange& m : plan.modules) EXPECT_NE(m.module, "a");
  CheckLayout(plan);
}

TEST(PlanState, ZeroSizeAndGradlessParamsArePlanned) {
  ProbeRecord r;
  r.forward_time = 0.01;
  r.backward_time = 0.02;
  r.params = {Param("empty", "a", 0, 0, 0.0, 0, 0.02), Param("w", "a", 300, 1, 0.005, 1, 0.025),
              Param("unused", "b", 7, -1, 0.0, -1, 0.0)};
  for (bool all_host : {false, true}) {
    PlanOptions o;
    o.force_all_host = all_host;
    const Plan plan = MustPlan(r, Gpu(), o);
    EXPECT_EQ(plan.params[0].state_bytes, 0u);
    EXPECT_EQ(plan.params[0].offload_rank, 2);  // frees nothing: last to move
    // Unused: needed by the end of the next forward, ready at the end of backward.
    EXPECT_DOUBLE_EQ(plan.params[2].slack, 0.01);
    EXPECT_EQ(plan.buckets.back().params.back(), 2);  // no gradient: last
    CheckLayout(plan);
  }
}

TEST(PlanLayout, ModulesFollowGradientReadyOrder) {
  const ProbeRecord r = Decoder(false);
  PlanOptions o;
  o.device_module_alignment = 4096;
  const Plan plan = MustPlan(r, DeviceProfile{}, o);
  CheckLayout(plan);
  // Device arena order = order of each module's first gradient.
  int64_t last = -1;
  uint64_t last_offset = 0;
  for (const ModuleRange& m : plan.modules) {
    int64_t first = INT64_MAX;
    for (const ParamRecord& p : r.params) {
      if (p.module == m.module) first = std::min(first, p.grad_ready_order);
    }
    EXPECT_GT(first, last) << m.module;
    EXPECT_GE(m.offset, last_offset);
    last = first;
    last_offset = m.offset;
  }
  EXPECT_EQ(plan.modules.front().module, "lm_head");
  EXPECT_EQ(plan.modules.back().module, "model.embed_tokens");
  // Big modules (>= 4 KiB here) start at the next 4 KiB boundary; small ones are packed at 256 B.
  uint64_t end = 0;
  size_t small = 0;
  for (const ModuleRange& m : plan.modules) {
    const uint64_t align = m.bytes >= 4096 ? 4096 : 256;
    small += m.bytes < 4096;
    EXPECT_EQ(m.offset, (end + align - 1) / align * align) << m.module;
    end = m.offset + m.bytes;
  }
  EXPECT_GT(small, 0u);
  EXPECT_EQ(plan.prediction.device_state_bytes, (end + 4095) / 4096 * 4096);
}

uint64_t AlignUpTo(uint64_t x, uint64_t align) { return (x + align - 1) / align * align; }

// The host arena: every view a copy to or from the device touches (a bf16 param's gradient
// staging, which its rounded value overwrites for the upload) in one locked prefix first, ending
// on an arena page; the moments and masters only CPU threads touch after it. A GPU-updated fp32
// param's moments are copied (streamed up and back), so they join the prefix, as does its fp32
// master.
TEST(PlanLayout, HostArenaPutsCopiedViewsFirst) {
  const ProbeRecord r = Decoder(false, DType::kBFloat16);
  PlanOptions o;
  o.force_all_host = true;
  o.device_update_share = 0;
  const Plan plan = MustPlan(r, Gpu(), o);
  CheckLayout(plan);
  const uint64_t locked = plan.prediction.host_locked_bytes;
  uint64_t copied = 0, pageable = 0;
  for (const ParamPlan& p : plan.params) {
    if (!p.trainable) continue;
    ASSERT_EQ(p.tier, Tier::kL2) << p.name;
    const uint64_t n = static_cast<uint64_t>(p.numel);
    EXPECT_LT(static_cast<uint64_t>(p.grad_offset), locked) << p.name;
    for (int64_t off : {p.exp_avg_offset, p.exp_avg_sq_offset, p.master_offset}) {
      EXPECT_GE(static_cast<uint64_t>(off), locked) << p.name;
    }
    copied += AlignUpTo(2 * n, o.host_tensor_alignment);
    pageable += 3 * AlignUpTo(4 * n, o.host_tensor_alignment);
  }
  EXPECT_EQ(locked, AlignUpTo(copied, kHostArenaPageBytes));
  EXPECT_EQ(plan.prediction.host_state_bytes, locked + pageable);

  ProbeRecord fp32 = Decoder(false);
  PlanOptions gpu;
  gpu.force_all_host = true;
  gpu.release_grads = true;  // the GPU path allowed
  gpu.bucket_bytes = 256 << 10;
  gpu.device_update_share = 1;
  const Plan streamed = MustPlan(fp32, Gpu(), gpu);
  CheckLayout(streamed);  // checks each view's side by the rule above
  size_t on_gpu = 0;
  for (const ParamPlan& p : streamed.params) {
    if (!p.trainable || !p.device_update) continue;
    ++on_gpu;
    EXPECT_LT(static_cast<uint64_t>(p.exp_avg_sq_offset), streamed.prediction.host_locked_bytes);
  }
  EXPECT_GT(on_gpu, 0u);
}

TEST(PlanLayout, TenThousandParams) {
  ProbeRecord r;
  r.forward_time = 1.0;
  r.backward_time = 2.0;
  const int n = 10000;
  for (int i = 0; i < n; ++i) {
    const int64_t numel = 1000 + (i * 7919) % 300000;
    r.params.push_back(Param("p" + std::to_string(i), "m" + std::to_string(i / 7), numel, i,
                             1.0 * i / n, n - 1 - i, 1.0 + 2.0 * (n - i) / n));
  }
  for (int i = 0; i < n; ++i) {
    GraphOp op;
    op.name = "op" + std::to_string(i);
    op.params = {"p" + std::to_string(i)};
    if (i > 0) op.inputs = {i - 1};
    if (i > 10) op.inputs.push_back(i - 11);
    r.graph.push_back(op);
  }
  PlanOptions o;
  const Plan unlimited = MustPlan(r, DeviceProfile{}, o);
  o.budget_bytes = (unlimited.min_budget_bytes + unlimited.prediction.peak_device_bytes) / 2;
  const Plan plan = MustPlan(r, Gpu(), o);
  EXPECT_LE(plan.prediction.peak_device_bytes, o.budget_bytes);
  EXPECT_GT(HostSet(plan).size(), 100u);
  EXPECT_DOUBLE_EQ(plan.params[0].centrality, 1.0);
  EXPECT_DOUBLE_EQ(plan.params[n - 1].centrality, 1.0 / n);
  CheckLayout(plan);
  CheckBuckets(r, plan);
}

// ---- buckets and prediction -----------------------------------------------------------------

TEST(PlanSchedule, BucketsRespectTierAndSize) {
  const ProbeRecord r = Decoder(false);
  PlanOptions o;
  o.device_update_share = 0;  // the CPU updates the host tier: no device staging

  o.bucket_bytes = 1 * kMiB;
  const Plan unlimited = MustPlan(r, DeviceProfile{}, o);
  o.budget_bytes = (unlimited.min_budget_bytes + unlimited.prediction.peak_device_bytes) / 2;
  const Plan plan = MustPlan(r, Gpu(), o);
  CheckBuckets(r, plan);
  std::set<Tier> tiers;
  for (const Bucket& b : plan.buckets) tiers.insert(b.tier);
  EXPECT_EQ(tiers.size(), 2u);
}

// Two 1 M-element parameters: forward 10 ms, backward 20 ms; a used first and ready last (30 ms),
// b used at 5 ms and ready at 15 ms.
ProbeRecord TwoParams() {
  ProbeRecord r;
  r.forward_time = 0.01;
  r.backward_time = 0.02;
  r.params = {Param("a", "a", 1000000, 0, 0.0, 1, 0.03),
              Param("b", "b", 1000000, 1, 0.005, 0, 0.015)};
  return r;
}

TEST(PlanSchedule, TimelineMatchesHandComputation) {
  const ProbeRecord r = TwoParams();
  const DeviceProfile profile = Gpu();
  PlanOptions o;
  o.device_update_share = 0;  // the CPU updates the host tier: no device staging

  const Plan device = MustPlan(r, profile, o);
  ASSERT_EQ(device.buckets.size(), 1u);
  const double hbm = 2e6 * 28 / 1e12;  // fp32 AdamW: 28 B per element
  EXPECT_DOUBLE_EQ(device.prediction.hbm_time, hbm);
  EXPECT_DOUBLE_EQ(device.prediction.period, 0.03);
  EXPECT_NEAR(device.prediction.stall_time, hbm, 1e-15);  // "a" is needed at P + 0
  EXPECT_NEAR(device.prediction.step_time, 0.03 + hbm, 1e-15);
  EXPECT_EQ(device.prediction.d2h_time, 0.0);

  o.force_all_host = true;
  o.bucket_bytes = 4000000;  // one param per bucket
  o.release_grads = true;    // each bucket's gradients go down as soon as it is ready
  const Plan host = MustPlan(r, profile, o);
  ASSERT_EQ(host.buckets.size(), 2u);
  // Host memory: the CPU's 24 B per element and the DMA's 8 (costs.h, HostMemoryTraffic).
  const double down = 4e6 / 10e9, cpu = 32e6 / 20e9, up = 4e6 / 10e9;
  EXPECT_DOUBLE_EQ(host.prediction.d2h_time, 2 * down);
  EXPECT_DOUBLE_EQ(host.prediction.cpu_time, 2 * cpu);
  EXPECT_DOUBLE_EQ(host.prediction.h2d_time, 2 * up);
  EXPECT_EQ(host.prediction.hbm_time, 0.0);
  // b: ready 0.015, done 0.015 + down + cpu + up (needed at 0.035); a: ready 0.03, the engines
  // are free again by then, needed at 0.03.
  EXPECT_NEAR(host.prediction.stall_time, down + cpu + up, 1e-12);

  // A slow host makes b's pipeline still busy when a arrives: a waits for the CPU.
  DeviceProfile slow = profile;
  slow.cpu.host_update_bandwidth = 1e9;
  const Plan queued = MustPlan(r, slow, o);
  const double slow_cpu = 32e6 / 1e9;
  const double b_cpu_done = 0.015 + down + slow_cpu;
  ASSERT_GT(b_cpu_done, 0.03 + down);
  const double a_done = b_cpu_done + slow_cpu + up;
  EXPECT_NEAR(queued.prediction.stall_time, a_done - 0.03, 1e-12);
  EXPECT_NEAR(queued.prediction.step_time, 0.03 + a_done - 0.03, 1e-12);

  // Gradients kept until step(): every bucket goes down at the end of backward, in forward
  // order (a, then b), and the CPU takes a first: a done at P + down + cpu + up; b lands at
  // P + 2 down, its CPU update follows a's.
  o.release_grads = false;
  const Plan at_step = MustPlan(r, slow, o);
  const double a_at_step = 0.03 + down + slow_cpu + up;
  const double b_at_step = 0.03 + down + 2 * slow_cpu + up;
  EXPECT_NEAR(at_step.prediction.stall_time, std::max(a_at_step - 0.03, b_at_step - (0.03 + 0.005)),
              1e-12);
}

// Gated steps in backward (clipping, the non-finite check, a loss scale): the gradients go down as
// they become final, but the CPU starts only at the end of backward (P = 0.03), on what has
// landed by then: b (landed at 0.015 + down), then a (landed at 0.03 + down, before b's update
// is done). a, needed at P, is done at P + 2 cpu + up; b, needed at P + 0.005, at P + cpu + up.
// Without release_grads every update waits for backward's end anyway: gated or not, the same.
TEST(PlanSchedule, GatedStepsUpdateOnlyAfterBackward) {
  const ProbeRecord r = TwoParams();
  const DeviceProfile profile = Gpu();
  PlanOptions o;
  o.device_update_share = 0;
  o.force_all_host = true;
  o.bucket_bytes = 4000000;  // one param per bucket
  o.release_grads = true;
  const Plan ungated = MustPlan(r, profile, o);
  o.gated_steps = true;
  const Plan gated = MustPlan(r, profile, o);
  const double down = 4e6 / 10e9, cpu = 32e6 / 20e9, up = 4e6 / 10e9;
  EXPECT_NEAR(ungated.prediction.stall_time, down + cpu + up, 1e-12);
  EXPECT_NEAR(gated.prediction.stall_time, 2 * cpu + up, 1e-12);
  EXPECT_NEAR(gated.prediction.step_time, 0.03 + 2 * cpu + up, 1e-12);
  EXPECT_NE(PlanToJson(gated).find("\"gated_steps\": true"), std::string::npos);

  o.release_grads = false;
  const Plan at_step_gated = MustPlan(r, profile, o);
  o.gated_steps = false;
  const Plan at_step = MustPlan(r, profile, o);
  EXPECT_DOUBLE_EQ(at_step_gated.prediction.step_time, at_step.prediction.step_time);
}

// The probe's forward + backward under the host tier's load (period_under_load) stretches a
// host-tier plan's period by the load's share of it, and every probe time with it; plans without
// a host tier, and records without the measurement or with a faster one, keep the probe's P.
TEST(PlanSchedule, LoadSlowdownStretchesTheHostTiersPeriod) {
  ProbeRecord r = TwoParams();
  const DeviceProfile profile = Gpu();
  PlanOptions o;
  o.device_update_share = 0;
  o.force_all_host = true;
  o.bucket_bytes = 4000000;
  o.release_grads = true;
  const double pa = 0.03;

  EXPECT_EQ(MustPlan(r, profile, o).prediction.load_slowdown, 1.0);  // not measured
  r.period_under_load = 0.02;                                        // faster: noise
  EXPECT_EQ(MustPlan(r, profile, o).prediction.load_slowdown, 1.0);

  // The CPU path busy 3.2 ms of the period, longer than the load would take for its bytes (32 B
  // per parameter, the update's 24 and the DMA's 8, at the CPU update's 20 GB/s plus the copies'
  // 10 GB/s each way: 1.6 ms): P = Pa + (PL - Pa) * busy / P, whose positive root is
  // P = (Pa + sqrt(Pa^2 + 4 (PL - Pa) busy)) / 2.
  const auto loaded_period = [pa](double busy) {
    return (pa + std::sqrt(pa * pa + 4 * (0.06 - pa) * busy)) / 2;
  };
  r.period_under_load = 0.06;
  const Plan light = MustPlan(r, profile, o);
  const double busy = 2e6 * 32 / 20e9;
  EXPECT_NEAR(light.prediction.cpu_time, busy, 1e-15);
  const double p = loaded_period(busy);
  EXPECT_GT(p, pa);
  EXPECT_LT(p, 0.06);
  EXPECT_NEAR(light.prediction.period, p, 1e-12);
  EXPECT_NEAR(light.prediction.load_slowdown, p / pa, 1e-10);

  // The GPU updating all: no CPU path, the moments both ways (2 x 8 B per parameter) at the
  // load's rate, 0.8 ms: less than their 1.6 ms on the links (which load the host less).
  o.device_update_share = 1;
  const Plan streamed = MustPlan(r, profile, o);
  ASSERT_EQ(streamed.prediction.cpu_time, 0.0);
  ASSERT_GT(streamed.prediction.h2d_time, 1.5e-3);
  EXPECT_NEAR(streamed.prediction.period, loaded_period(2e6 * 16 / 40e9), 1e-12);
  o.device_update_share = 0;

  // A host busier than the loaded period (64 MB at 0.5 + 2 x 0.25 GB/s): the whole period is
  // under load, P = PL, twice the probe's, and the timeline with it (b ready at 0.03, a at 0.06;
  // a needed at P, b at P + 0.01).
  DeviceProfile slow = profile;
  slow.cpu.host_update_bandwidth = 0.5e9;
  slow.gpu.d2h_bandwidth = slow.gpu.h2d_bandwidth = 0.25e9;
  const double down = 4e6 / 0.25e9, up = down;
  const Plan heavy = MustPlan(r, slow, o);
  const double cpu = 32e6 / 0.5e9;
  EXPECT_DOUBLE_EQ(heavy.prediction.period, 0.06);
  EXPECT_DOUBLE_EQ(heavy.prediction.load_slowdown, 2.0);
  const double b_done = 0.03 + down + cpu + up, a_done = 0.03 + down + 2 * cpu + up;
  const double heavy_stall = std::max(a_done - 0.06, b_done - 0.07);
  EXPECT_NEAR(heavy.prediction.stall_time, heavy_stall, 1e-12);
  EXPECT_NEAR(heavy.prediction.step_time, 0.06 + heavy_stall, 1e-12);

  // No host tier: the load is not there.
  o.force_all_host = false;
  const Plan device = MustPlan(r, slow, o);
  ASSERT_EQ(device.prediction.d2h_time, 0.0);
  EXPECT_EQ(device.prediction.load_slowdown, 1.0);
  EXPECT_DOUBLE_EQ(device.prediction.period, pa);
}

// The copies both ways under the CPU update (duplex_under_update_bandwidth) time the links for
// the share of their busy time the CPU path works alongside; without a CPU path, the links keep
// their rates.
TEST(PlanSchedule, LinksSlowWhileTheCpuPathUpdates) {
  const ProbeRecord r = TwoParams();
  DeviceProfile profile = Gpu();  // links 10 GB/s each way, the CPU 20 GB/s
  PlanOptions o;
  o.device_update_share = 0;
  o.force_all_host = true;
  o.bucket_bytes = 4000000;
  o.release_grads = true;
  const double down = 8e6 / 10e9;  // both gradients
  EXPECT_NEAR(MustPlan(r, profile, o).prediction.d2h_time, down, 1e-15);
  profile.gpu.duplex_under_update_bandwidth = 5e9;
  // The CPU path (3.2 ms) outlasts the links (0.8 ms): at half the rate throughout.
  const Plan slow = MustPlan(r, profile, o);
  EXPECT_NEAR(slow.prediction.d2h_time, 2 * down, 1e-15);
  EXPECT_NEAR(slow.prediction.h2d_time, 2 * down, 1e-15);
  // A CPU 50x faster (0.064 ms): the links at half their rate while it works, L + Tc / 2.
  profile.cpu.host_update_bandwidth = 1e12;
  const Plan brief = MustPlan(r, profile, o);
  EXPECT_NEAR(brief.prediction.d2h_time, down + (64e6 / 1e12) * (1 - 0.5), 1e-15);
  // The GPU updating all: no CPU path, the moments each way (8 B per parameter) at the duplex
  // rate.
  o.device_update_share = 1;
  const Plan streamed = MustPlan(r, profile, o);
  ASSERT_EQ(streamed.prediction.cpu_time, 0.0);
  EXPECT_NEAR(streamed.prediction.h2d_time, 2e6 * 8 / 10e9, 1e-15);
}

TEST(PlanSchedule, PeakIsBasePlusDeviceArena) {
  const ProbeRecord r = Decoder(true);
  const Plan plan = MustPlan(r, DeviceProfile{}, PlanOptions{});
  EXPECT_EQ(plan.prediction.peak_device_bytes, BaseBytes(r) + plan.prediction.device_state_bytes);
  uint64_t state = 0;
  for (const ParamPlan& p : plan.params) state += p.state_bytes;
  EXPECT_GE(plan.prediction.device_state_bytes, state);
}

// Gradients freed in backward: each sample loses the gradients final by its time; two buckets
// stay in flight. A hand-made record makes the arithmetic exact.
TEST(PlanSchedule, ReleasedGradientsLeaveThePeak) {
  ProbeRecord r;
  r.forward_time = 0.01;
  r.backward_time = 0.02;
  r.params.push_back(Param("a.w", "a", 1 << 20, 0, 0.0, 1, 0.03));    // 4 MiB, last ready
  r.params.push_back(Param("b.w", "b", 2 << 20, 1, 0.005, 0, 0.02));  // 8 MiB, first ready
  const uint64_t mib = 1 << 20;
  // Params 12 MiB; at 0.01 s (backward starts) activations 20 MiB; at 0.025 s b's gradient
  // (8 MiB) exists and 5 MiB of activations.
  r.memory.push_back({"a", "forward_post", 0.01, 32 * mib});
  r.memory.push_back({"b", "backward_post", 0.025, 25 * mib});
  r.peak_device_bytes = 36 * mib;  // a transient next to the largest sample (no gradient yet)
  r.activation_peak_bytes = 24 * mib;
  PlanOptions o;
  o.budget_bytes = 0;
  o.bucket_bytes = 1 * mib;  // two in flight: 2 MiB
  const Plan kept = MustPlan(r, DeviceProfile{}, o);
  o.release_grads = true;
  const Plan released = MustPlan(r, DeviceProfile{}, o);
  const uint64_t kept_base = kept.prediction.peak_device_bytes - kept.prediction.device_state_bytes;
  const uint64_t released_base =
      released.prediction.peak_device_bytes - released.prediction.device_state_bytes;
  EXPECT_EQ(kept_base, 36 * mib);
  // max(36 - 0 (the peak, at 0.01 s: no gradient final), 32 - 0, 25 - 8) + 2 = 38 MiB: the
  // in-flight buckets now sit on top of the peak.
  EXPECT_EQ(released_base, 38 * mib);
  // Later samples lose their gradients: with the peak at the last sample, 8 MiB are gone.
  r.memory[1].device_bytes = 40 * mib;
  r.peak_device_bytes = 41 * mib;
  const Plan late = MustPlan(r, DeviceProfile{}, o);
  EXPECT_EQ(late.prediction.peak_device_bytes - late.prediction.device_state_bytes,
            (41 - 8 + 2) * mib);
  o.bucket_bytes = 64 * mib;  // in flight never exceeds all gradients (12 MiB)
  const Plan big = MustPlan(r, DeviceProfile{}, o);
  EXPECT_EQ(big.prediction.peak_device_bytes - big.prediction.device_state_bytes,
            (41 - 8 + 12) * mib);
}

// ---- GPU-updated host-tier parameters (PlanOptions::device_update_share) -------------------

// All state on the host, gradients released in backward (the GPU path allowed), small buckets.
PlanOptions AllHostInBackward() {
  PlanOptions o;
  o.force_all_host = true;
  o.release_grads = true;
  o.bucket_bytes = 256 << 10;
  return o;
}

// Gpu() with each link and the CPU update at the given rates.
DeviceProfile LinksAndHost(double link, double host_update) {
  DeviceProfile p = Gpu();
  p.gpu.d2h_bandwidth = p.gpu.h2d_bandwidth = link;
  p.cpu.host_update_bandwidth = host_update;
  return p;
}

// Every state on the host, a bf16 parameter among fp32 ones. Share 1: every bucket of fp32
// parameters is GPU-updated, the bf16 one's bucket not (it has a master); the staging
// (3 slots of the largest GPU-updated tensor, capped at 8 Mi elements, two fp32 moments) is in
// the predicted peak. Share 0: none, no staging. No GPU: none.
TEST(PlanDeviceUpdate, ShareOneTakesEveryFp32ParameterAndCountsItsStaging) {
  ProbeRecord r = Decoder(false);
  r.params[1].dtype = DType::kBFloat16;
  r.params[1].bytes = static_cast<uint64_t>(r.params[1].numel) * 2;
  PlanOptions o;
  o.force_all_host = true;
  o.bucket_bytes = 256 << 10;
  o.device_update_share = 1;
  const Plan all = MustPlan(r, Gpu(), o);
  int64_t largest = 0;
  for (const ParamPlan& p : all.params) {
    if (!p.trainable) continue;
    EXPECT_EQ(p.tier, Tier::kL2) << p.name;
    if (p.device_update) largest = std::max(largest, p.numel);
  }
  for (const Bucket& b : all.buckets) {  // whole buckets: those of fp32 parameters only
    bool fp32 = true;
    for (int64_t i : b.params) fp32 = fp32 && all.params[i].param_dtype == DType::kFloat32;
    EXPECT_EQ(b.device_update, fp32);
    for (int64_t i : b.params) {
      EXPECT_EQ(all.params[static_cast<size_t>(i)].device_update, b.device_update);
    }
  }
  const uint64_t staging = 3u * static_cast<uint64_t>(std::min<int64_t>(largest, 8 << 20)) * 8u;
  EXPECT_EQ(all.prediction.stream_staging_bytes, staging);
  EXPECT_EQ(all.prediction.peak_device_bytes,
            all.prediction.device_state_bytes + staging + BaseBytes(r));
  EXPECT_GT(all.prediction.device_update_share, 0.9);
  EXPECT_LT(all.prediction.device_update_share, 1.0);
  EXPECT_NE(PlanToJson(all).find("\"device_update\": true"), std::string::npos);

  o.device_update_share = 0;
  const Plan none = MustPlan(r, Gpu(), o);
  for (const ParamPlan& p : none.params) EXPECT_FALSE(p.device_update) << p.name;
  EXPECT_EQ(none.prediction.stream_staging_bytes, 0u);
  EXPECT_EQ(none.prediction.device_update_share, 0.0);
  o.device_update_share = -1;
  const Plan cpu_only = MustPlan(r, DeviceProfile{}, o);  // no GPU in the profile
  for (const ParamPlan& p : cpu_only.params) EXPECT_FALSE(p.device_update) << p.name;
}

// The balanced share (-1): as many fp32 buckets as make the host's memory and the links equally
// busy by the model in plan.h, spread over the gradient-ready order (the GPU's running share of
// the elements seen stays within a bucket of it); its predicted step is no longer than with the
// CPU or the GPU updating everything.
TEST(PlanDeviceUpdate, BalancedShareIsSpreadOverBackwardAndPredictsNoWorse) {
  const ProbeRecord r = Decoder(false, DType::kFloat32, 8);
  DeviceProfile profile = LinksAndHost(50e9, 150e9);
  PlanOptions o = AllHostInBackward();
  const Plan balanced = MustPlan(r, profile, o);
  // By hand: per parameter the CPU path costs 32 B of host memory and 4 B each way over PCIe,
  // the GPU path 16 B and 8 B: equal busy times at s with (32 - 16 s) / 150 = (4 + 4 s) / 50.
  const double s = (32.0 / 150 - 4.0 / 50) / (16.0 / 150 + 4.0 / 50);
  EXPECT_NEAR(balanced.prediction.device_update_share, s, 0.1);
  double seen = 0, taken = 0, largest = 0;
  for (const Bucket& b : balanced.buckets) {
    for (int64_t i : b.params) {  // the shares tried on the way left no member marked
      EXPECT_EQ(balanced.params[static_cast<size_t>(i)].device_update, b.device_update);
    }
    double n = 0;
    for (int64_t i : b.params)
      n += static_cast<double>(balanced.params[static_cast<size_t>(i)].numel);
    largest = std::max(largest, n);
    seen += n;
    if (b.device_update) taken += n;
    EXPECT_LE(std::abs(taken - s * seen), largest) << "after " << seen << " elements";
  }
  for (double share : {0.0, 1.0}) {
    o.device_update_share = share;
    const Plan fixed = MustPlan(r, profile, o);
    EXPECT_LE(balanced.prediction.step_time, fixed.prediction.step_time * (1 + 1e-9))
        << "share " << share;
  }
  // With the CPU's rate measured while copies run both ways (110 of 150 GB/s), the CPU path is
  // charged that rate instead of the moments' bytes: (32 - 32 s) / 110 = (4 + 4 s) / 50.
  profile.gpu.host_update_duplex_bandwidth = 110e9;
  o.device_update_share = -1;
  const Plan measured = MustPlan(r, profile, o);
  const double s2 = (32.0 / 110 - 4.0 / 50) / (32.0 / 110 + 4.0 / 50);
  EXPECT_NEAR(measured.prediction.device_update_share, s2, 0.1);
  EXPECT_LT(measured.prediction.device_update_share, balanced.prediction.device_update_share);
}

// Under the host tier's load (period_under_load measured) the GPU path, half the CPU path's
// host-memory bytes per parameter, also shortens the framework's period: the planner predicts the
// shares 0, 0.05, ..., 1 and keeps the shortest step of those that predict no stall, here more
// GPU than the balanced share and more than 1% shorter; no share of the grid predicts shorter.
// With slow links the shortest steps stall and are not taken. A share asked for is kept.
TEST(PlanDeviceUpdate, UnderLoadTheShareWithTheShortestPredictedStepIsKept) {
  // A slower framework (every probe time x1000): the host tier's engines busy a few % of it,
  // the load (x10 under it) a large part.
  ProbeRecord r = Decoder(false, DType::kFloat32, 8);
  r.forward_time *= 1000;
  r.backward_time *= 1000;
  for (ParamRecord& p : r.params) {
    p.forward_time *= 1000;
    p.grad_ready_time *= 1000;
  }
  for (MemorySample& m : r.memory) m.time *= 1000;
  DeviceProfile profile = LinksAndHost(150e9, 450e9);
  PlanOptions o = AllHostInBackward();
  const double balanced_share = (32.0 / 450 - 4.0 / 150) / (16.0 / 450 + 4.0 / 150);
  const double pa = r.forward_time + r.backward_time;
  r.period_under_load = 10 * pa;
  const Plan chosen = MustPlan(r, profile, o);
  o.device_update_share = balanced_share;
  const Plan balanced = MustPlan(r, profile, o);
  EXPECT_GT(chosen.prediction.device_update_share, balanced.prediction.device_update_share + 0.04);
  EXPECT_LT(chosen.prediction.step_time, balanced.prediction.step_time * 0.99);
  EXPECT_LT(chosen.prediction.load_slowdown, balanced.prediction.load_slowdown);
  for (int k = 0; k <= 20; ++k) {
    o.device_update_share = k / 20.0;
    const Plan fixed = MustPlan(r, profile, o);
    EXPECT_LE(chosen.prediction.step_time, fixed.prediction.step_time * (1 + 1e-12))
        << "share " << k / 20.0;
    EXPECT_NEAR(fixed.prediction.device_update_share, k / 20.0, 0.1);  // asked: kept
  }
  EXPECT_LE(chosen.prediction.stall_time, 0.01 * chosen.prediction.period);

  // Links a tenth as fast: the GPU path's moments outlast the period at high shares, and a share
  // that the timeline says stalls is not taken, however short its step is predicted.
  profile.gpu.d2h_bandwidth = profile.gpu.h2d_bandwidth = 15e9;
  o.device_update_share = -1;
  const Plan slow_links = MustPlan(r, profile, o);
  // Kept: a share that predicts no stall, or the balanced one, 0 here (the CPU path's 32 B at
  // 450 GB/s are quicker than the links' 4 B each way at 15 GB/s).
  if (slow_links.prediction.stall_time > 0.01 * slow_links.prediction.period) {
    EXPECT_EQ(slow_links.prediction.device_update_share, 0.0);
  }
  bool a_stalling_share_was_shorter = false;
  for (int k = 0; k <= 20; ++k) {
    o.device_update_share = k / 20.0;
    const Plan fixed = MustPlan(r, profile, o);
    const bool stalls = fixed.prediction.stall_time > 0.01 * fixed.prediction.period;
    if (!stalls) {
      EXPECT_LE(slow_links.prediction.step_time, fixed.prediction.step_time * (1 + 1e-12));
    }
    a_stalling_share_was_shorter =
        a_stalling_share_was_shorter ||
        (stalls && fixed.prediction.step_time < slow_links.prediction.step_time);
  }
  EXPECT_TRUE(a_stalling_share_was_shorter);
}

// Gated steps with the GPU path: the planner keeps the share it chooses for ungated steps (a
// share chosen among the gated predictions measured no faster) and predicts the wait for
// backward's end: at every share the gated step is predicted no shorter than the ungated one, and
// stalls (the host tier has work left when backward ends).
TEST(PlanDeviceUpdate, GatedStepsKeepTheUngatedShareAndPredictTheWait) {
  const ProbeRecord r = Decoder(false, DType::kFloat32, 8);
  const DeviceProfile profile = LinksAndHost(50e9, 150e9);
  PlanOptions o = AllHostInBackward();
  const Plan ungated_choice = MustPlan(r, profile, o);
  o.gated_steps = true;
  const Plan gated_choice = MustPlan(r, profile, o);
  EXPECT_EQ(gated_choice.prediction.device_update_share,
            ungated_choice.prediction.device_update_share);
  EXPECT_GT(gated_choice.prediction.step_time, ungated_choice.prediction.step_time);
  EXPECT_TRUE(gated_choice.options.gated_steps);
  for (int k = 0; k <= 20; ++k) {
    o.device_update_share = k / 20.0;
    o.gated_steps = true;
    const Plan gated = MustPlan(r, profile, o);
    o.gated_steps = false;
    const Plan ungated = MustPlan(r, profile, o);
    EXPECT_GE(gated.prediction.step_time, ungated.prediction.step_time * (1 - 1e-12))
        << "share " << k / 20.0;
    EXPECT_GT(gated.prediction.stall_time, 0.0) << "share " << k / 20.0;
  }
}

// ---- options and input ----------------------------------------------------------------------

TEST(PlanOptionsCheck, BadOptionsAreRejectedAndChangeNothing) {
  const ProbeRecord r = Decoder(false);
  std::vector<std::pair<std::string, PlanOptions>> cases;
  PlanOptions o;
  o.bucket_bytes = 0;
  cases.push_back({"bucket_bytes", o});
  o = PlanOptions{};
  o.device_tensor_alignment = 384;
  cases.push_back({"device_tensor_alignment", o});
  o = PlanOptions{};
  o.host_tensor_alignment = 0;
  cases.push_back({"host_tensor_alignment", o});
  o = PlanOptions{};
  o.device_module_alignment = 128;
  cases.push_back({"device_module_alignment", o});
  o = PlanOptions{};
  o.state_dtype = DType::kFloat16;
  cases.push_back({"state_dtype", o});
  o = PlanOptions{};
  o.optimizer = static_cast<OptimizerKind>(7);
  cases.push_back({"optimizer", o});
  for (double share : {1.5, -0.5}) {
    o = PlanOptions{};
    o.device_update_share = share;
    cases.push_back({"device_update_share", o});
  }
  o = PlanOptions{};
  o.force_all_host = true;
  o.allow_host_tier = false;
  cases.push_back({"force_all_host", o});
  for (const auto& [field, options] : cases) {
    uint64_t min = 12345;
    Result<Plan> plan = MakePlan(r, Gpu(), options, &min);
    ASSERT_FALSE(plan.ok()) << field;
    EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument) << field;
    EXPECT_NE(plan.status().message().find(field), std::string::npos) << plan.status().message();
    EXPECT_EQ(min, 12345u) << field;
  }
}

TEST(PlanOptionsCheck, InvalidRecordIsRejected) {
  ProbeRecord r = Decoder(false);
  r.params[3].bytes += 1;
  Result<Plan> plan = MakePlan(r, Gpu(), PlanOptions{});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("probe record"), std::string::npos);
  EXPECT_NE(plan.status().message().find(r.params[3].name), std::string::npos)
      << plan.status().message();
}

TEST(PlanOptionsCheck, EmptyRecordGivesEmptyPlan) {
  ProbeRecord r;
  const Plan plan = MustPlan(r, Gpu(), PlanOptions{});
  EXPECT_TRUE(plan.params.empty());
  EXPECT_TRUE(plan.buckets.empty());
  EXPECT_EQ(plan.prediction.device_state_bytes, 0u);
  EXPECT_EQ(plan.prediction.step_time, 0.0);
}

// ---- output ---------------------------------------------------------------------------------

TEST(PlanOutput, JsonIsDeterministicAndComplete) {
  ProbeRecord r = Decoder(false, DType::kBFloat16);
  r.graph = {{"embed", {"model.embed_tokens.weight"}, {}}, {"head", {"lm_head.weight"}, {0}}};
  PlanOptions o;
  const Plan unlimited = MustPlan(r, DeviceProfile{}, o);
  o.budget_bytes = (unlimited.min_budget_bytes + unlimited.prediction.peak_device_bytes) / 2;
  const Plan a = MustPlan(r, Gpu(), o);
  const Plan b = MustPlan(r, Gpu(), o);
  const std::string text = PlanToJson(a);
  EXPECT_EQ(text, PlanToJson(b));

  Result<json::Value> doc = json::Parse(text);
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  json::Reader root(*doc, "plan");
  EXPECT_EQ(*root.String("format"), "emsa.plan");
  EXPECT_EQ(*root.Int("version"), 1);
  EXPECT_EQ(*root.UInt("budget_bytes"), a.budget_bytes);
  EXPECT_EQ(*root.UInt("min_budget_bytes"), a.min_budget_bytes);
  auto params = root.Array("params");
  ASSERT_TRUE(params.ok());
  ASSERT_EQ(params->size(), a.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    const json::Reader& p = (*params)[i];
    const ParamPlan& q = a.params[i];
    EXPECT_EQ(*p.String("name"), q.name);
    EXPECT_EQ(*p.String("tier"), TierName(q.tier));
    EXPECT_EQ(*p.Int("exp_avg_offset"), q.exp_avg_offset);
    EXPECT_EQ(*p.Int("bucket"), q.bucket);
    EXPECT_EQ(*p.UInt("state_bytes"), q.state_bytes);
    EXPECT_EQ(*p.Number("hotness"), q.hotness);
    EXPECT_EQ(*p.Number("centrality"), q.centrality);
  }
  auto buckets = root.Array("buckets");
  ASSERT_TRUE(buckets.ok());
  EXPECT_EQ(buckets->size(), a.buckets.size());
  auto modules = root.Array("modules");
  ASSERT_TRUE(modules.ok());
  EXPECT_EQ(modules->size(), a.modules.size());
  auto prediction = root.Object("prediction");
  ASSERT_TRUE(prediction.ok());
  EXPECT_EQ(*prediction->Number("step_time"), a.prediction.step_time);
  EXPECT_EQ(*prediction->UInt("peak_device_bytes"), a.prediction.peak_device_bytes);
  EXPECT_EQ(*prediction->UInt("host_locked_bytes"), a.prediction.host_locked_bytes);
  auto options = root.Object("options");
  ASSERT_TRUE(options.ok());
  EXPECT_EQ(*options->String("optimizer"), "adamw");
  EXPECT_EQ(*options->UInt("bucket_bytes"), o.bucket_bytes);
}

TEST(PlanOutput, TableListsEveryParamAndSummaryDoesNot) {
  ProbeRecord r = Decoder(false);
  const std::string long_name(80, 'x');
  r.params.push_back(Param(long_name + ".tail", "long", 10, 1000, 0.0, 1000, 0.0));
  r.params.back().forward_time = r.forward_time;
  r.params.back().grad_ready_time = r.forward_time + r.backward_time;
  PlanOptions o;
  o.device_update_share = 0;  // the CPU updates the host tier: no device staging

  const Plan unlimited = MustPlan(r, DeviceProfile{}, o);
  o.budget_bytes = (unlimited.min_budget_bytes + unlimited.prediction.peak_device_bytes) / 2;
  const Plan plan = MustPlan(r, Gpu(), o);
  const std::string table = PlanToTable(plan);
  for (const ParamPlan& p : plan.params) {
    if (p.name.size() <= 44) EXPECT_NE(table.find(p.name), std::string::npos) << p.name;
  }
  EXPECT_EQ(table.find(long_name), std::string::npos);
  EXPECT_NE(table.find("..." + std::string(36, 'x') + ".tail "), std::string::npos);
  const std::string budget = "budget " + FormatBytes(o.budget_bytes);
  for (const std::string& part : {std::string("module ranges"), std::string("L1 (device)"),
                                  std::string("L2 (host)"), std::string("stall"), budget}) {
    EXPECT_NE(table.find(part), std::string::npos) << part;
  }
  // Every line of the per-parameter section has the same width.
  size_t rows = 0, width = 0;
  size_t pos = table.find("\n", table.find("   idx")) + 1;
  while (rows < plan.params.size()) {
    const size_t end = table.find('\n', pos);
    if (rows == 0) width = end - pos;
    EXPECT_EQ(end - pos, width) << table.substr(pos, end - pos);
    pos = end + 1;
    ++rows;
  }
  const std::string summary = PlanSummaryToTable(plan);
  EXPECT_EQ(summary.find("model.layers.0"), std::string::npos);
  EXPECT_NE(summary.find("prediction"), std::string::npos);
  EXPECT_NE(summary.find("smallest budget that works"), std::string::npos);
}

}  // namespace
}  // namespace emsa
