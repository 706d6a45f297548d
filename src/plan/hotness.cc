// hotness.cc — slack, cost, centrality, hotness; the offload order.
#include "plan/hotness.h"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <map>
#include <string>

namespace emsa::plan_internal {

double ElementCost(DType param_dtype, const PlanOptions& options, const Bandwidths& bw) {
  const double param = static_cast<double>(DTypeSize(param_dtype));
  const double host = static_cast<double>(HostMemoryTraffic(1, param_dtype, options));
  return param / bw.d2h + host / bw.host_update + param / bw.h2d;
}

double Period(const ProbeRecord& record) { return record.forward_time + record.backward_time; }

double ForwardNeed(const ProbeRecord& record, const ParamRecord& param) {
  return param.forward_order >= 0 ? param.forward_time : record.forward_time;
}

double GradReady(const ProbeRecord& record, const ParamRecord& param) {
  return param.grad_ready_order >= 0 ? param.grad_ready_time : Period(record);
}

std::vector<double> GraphCentrality(const ProbeRecord& record) {
  const size_t num_params = record.params.size();
  std::vector<double> centrality(num_params, 0.0);
  const size_t num_ops = record.graph.size();
  if (num_ops == 0) return centrality;

  std::map<std::string, size_t> by_name;  // ordered: no hash-order dependence anywhere
  for (size_t p = 0; p < num_params; ++p) {
    by_name.emplace(record.params[p].name, p);
    for (const std::string& alias : record.params[p].tied_names) by_name.emplace(alias, p);
  }
  // seeds[p]: the ops that read parameter p, deduplicated.
  std::vector<std::vector<size_t>> seeds(num_params);
  for (size_t op = 0; op < num_ops; ++op) {
    for (const std::string& name : record.graph[op].params) {
      auto it = by_name.find(name);
      if (it == by_name.end()) continue;
      std::vector<size_t>& s = seeds[it->second];
      if (s.empty() || s.back() != op) s.push_back(op);
    }
  }

  // Ops are topologically ordered (inputs are earlier ops), so one backward sweep per block of 64
  // target ops gives, for every op, which of those targets it reaches. Ops after the block
  // cannot reach into it, so each sweep starts at the block's end.
  std::vector<uint64_t> reach(num_ops);
  std::vector<uint64_t> count(num_params, 0);
  for (size_t block = 0; block < num_ops; block += 64) {
    const size_t end = std::min(num_ops, block + 64);
    std::fill(reach.begin(), reach.begin() + static_cast<std::ptrdiff_t>(end), 0);
    for (size_t v = end; v-- > 0;) {
      if (v >= block) reach[v] |= 1ull << (v - block);
      if (reach[v] == 0) continue;
      for (int64_t u : record.graph[v].inputs) {
        if (u >= 0 && static_cast<size_t>(u) < v) reach[static_cast<size_t>(u)] |= reach[v];
      }
    }
    for (size_t p = 0; p < num_params; ++p) {
      uint64_t mask = 0;
      for (size_t op : seeds[p]) {
        if (op < end) mask |= reach[op];  // later ops keep stale bits: they reach nothing here
      }
      count[p] += static_cast<uint64_t>(__builtin_popcountll(mask));
    }
  }
  for (size_t p = 0; p < num_params; ++p) {
    centrality[p] = static_cast<double>(count[p]) / static_cast<double>(num_ops);
  }
  return centrality;
}

void ComputeHeat(const ProbeRecord& record, const Bandwidths& bw, const PlanOptions& options,
                 std::vector<ParamPlan>* params) {
  const double period = Period(record);
  const std::vector<double> centrality = GraphCentrality(record);
  for (size_t p = 0; p < params->size(); ++p) {
    ParamPlan& plan = (*params)[p];
    if (!plan.trainable) continue;
    const ParamRecord& rec = record.params[p];
    const double slack = period + ForwardNeed(record, rec) - GradReady(record, rec);
    plan.slack = std::max(slack, kMinSlack);
    plan.cost = static_cast<double>(rec.numel) * ElementCost(rec.dtype, options, bw);
    plan.centrality = centrality[p];
    plan.hotness = plan.cost / plan.slack * (1.0 + plan.centrality);
  }
}

std::vector<int64_t> OffloadOrder(const PlanOptions& options, const Bandwidths& bw,
                                  std::vector<ParamPlan>* params) {
  struct Key {
    double per_byte;
    double hotness;
    int64_t index;
  };
  std::vector<Key> keys;
  for (const ParamPlan& p : *params) {
    if (!p.trainable) continue;
    // From per-element figures, so that params of one dtype with equal windows tie exactly and
    // the tie-break below decides, not rounding.
    const double cost_per_element = ElementCost(p.param_dtype, options, bw);
    const uint64_t freed = PaddedStateBytes(Tier::kL1, 1, p.param_dtype, options, 1);
    const double per_byte = p.numel == 0 ? std::numeric_limits<double>::infinity()
                                         : cost_per_element / static_cast<double>(freed) / p.slack *
                                               (1.0 + p.centrality);
    keys.push_back({per_byte, p.hotness, p.index});
  }
  // Equal per byte (e.g. every window is empty): the absolutely hotter stays on the device longer.
  std::sort(keys.begin(), keys.end(), [](const Key& a, const Key& b) {
    if (a.per_byte != b.per_byte) return a.per_byte < b.per_byte;
    if (a.hotness != b.hotness) return a.hotness < b.hotness;
    return a.index < b.index;
  });
  std::vector<int64_t> order;
  order.reserve(keys.size());
  for (const Key& k : keys) {
    (*params)[static_cast<size_t>(k.index)].offload_rank = static_cast<int64_t>(order.size());
    order.push_back(k.index);
  }
  return order;
}

}  // namespace emsa::plan_internal
