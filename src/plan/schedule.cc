// schedule.cc — buckets and the timeline that predicts the step.
#include "plan/schedule.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "plan/hotness.h"

namespace emsa::plan_internal {

void MakeBuckets(const ProbeRecord& record, const LayoutOrder& order, Plan* plan) {
  plan->buckets.clear();
  const uint64_t limit = plan->options.bucket_bytes;
  for (int64_t i : order.grad_order) {
    ParamPlan& p = plan->params[static_cast<size_t>(i)];
    const ParamRecord& rec = record.params[static_cast<size_t>(i)];
    Bucket* last = plan->buckets.empty() ? nullptr : &plan->buckets.back();
    if (last == nullptr || last->tier != p.tier || last->param_bytes + rec.bytes > limit) {
      plan->buckets.push_back({p.tier, false, {}, 0.0, 0});
      last = &plan->buckets.back();
    }
    last->params.push_back(i);
    last->param_bytes += rec.bytes;
    last->ready_time = std::max(last->ready_time, GradReady(record, rec));
    p.bucket = static_cast<int64_t>(plan->buckets.size()) - 1;
  }
}

namespace {

// Over the host tier, the bytes through host memory and over each link of what the CPU must
// update (fixed_*), and of the eligible buckets on the CPU path (cpu_*) or the GPU path (gpu_*).
struct HostPathBytes {
  double fixed_host = 0, fixed_link = 0, cpu_host = 0, cpu_link = 0, gpu_host = 0, gpu_link = 0;
  double eligible = 0;  // elements the GPU may update
};

// Clears every device_update mark and sums *bytes; returns each bucket's elements where the GPU
// may update it, else 0.
std::vector<double> EligibleBuckets(const ProbeRecord& record, bool gpu_present, Plan* plan,
                                    HostPathBytes* bytes) {
  const PlanOptions& o = plan->options;
  std::vector<double> elements(plan->buckets.size(), 0.0);
  for (size_t b = 0; b < plan->buckets.size(); ++b) {
    Bucket& bucket = plan->buckets[b];
    bucket.device_update = false;
    for (int64_t i : bucket.params) plan->params[static_cast<size_t>(i)].device_update = false;
    if (bucket.tier != Tier::kL2) continue;
    bool can = DeviceUpdatesAllowed(o, gpu_present);
    double host = 0, link = 0, moments = 0, n = 0;
    for (int64_t i : bucket.params) {
      const ParamRecord& rec = record.params[static_cast<size_t>(i)];
      can = can && DeviceUpdatable(rec.dtype);
      host += static_cast<double>(HostMemoryTraffic(rec.numel, rec.dtype, o));
      link += static_cast<double>(rec.bytes);  // gradient down, update up
      moments += static_cast<double>(DeviceUpdateLinkBytes(rec.numel, o));
      n += static_cast<double>(rec.numel);
    }
    if (!can || n == 0) {
      bytes->fixed_host += host;
      bytes->fixed_link += link;
      continue;
    }
    bytes->cpu_host += host;
    bytes->cpu_link += link;
    bytes->gpu_host += 2 * moments;
    bytes->gpu_link += moments;
    bytes->eligible += n;
    elements[b] = n;
  }
  return elements;
}

// The share at which the CPU path and the links are busy equally long. The moments go up and
// down at once. The CPU's rate with the DMA running where the profile measured it; else its rate
// alone, with the DMA's moments charged to the host's memory in full.
double BalancedShare(const Bandwidths& bw, const HostPathBytes& s) {
  const double link_bw = bw.duplex;
  const bool measured = bw.host_update_duplex > 0;
  const double h = measured ? bw.host_update_duplex : bw.host_update;
  const double dma_host = measured ? 0.0 : s.gpu_host;
  const double gap = (s.fixed_host + s.cpu_host) / h - (s.fixed_link + s.cpu_link) / link_bw;
  const double slope = (s.cpu_host - dma_host) / h + (s.gpu_link - s.cpu_link) / link_bw;
  return slope > 0 ? std::clamp(gap / slope, 0.0, 1.0) : (gap > 0 ? 1.0 : 0.0);
}

// Spread over the gradient-ready order, so both paths have work from the first gradients on:
// each eligible bucket goes where the GPU's running share of the elements seen stays nearest
// `share`.
void SpreadShare(double share, const std::vector<double>& elements, Plan* plan) {
  double seen = 0, taken = 0;
  for (size_t b = 0; b < plan->buckets.size(); ++b) {
    if (elements[b] == 0) continue;
    seen += elements[b];
    const double want = share * seen;
    if (std::abs(taken + elements[b] - want) < std::abs(taken - want)) {
      taken += elements[b];
      plan->buckets[b].device_update = true;
      for (int64_t i : plan->buckets[b].params) {
        plan->params[static_cast<size_t>(i)].device_update = true;
      }
    }
  }
}

}  // namespace

void ChooseDeviceUpdates(const ProbeRecord& record, const Bandwidths& bw, bool gpu_present,
                         double asked, Plan* plan) {
  HostPathBytes bytes;
  const std::vector<double> elements = EligibleBuckets(record, gpu_present, plan, &bytes);
  double share = bytes.eligible > 0 ? asked : 0.0;  // none eligible unless allowed
  if (share < 0) share = BalancedShare(bw, bytes);
  SpreadShare(share, elements, plan);
}

namespace {

// One bucket's engine work in seconds at full bandwidth.
struct Work {
  double hbm = 0, d2h = 0, cpu = 0, h2d = 0;
};

// What a step asks of each engine, per bucket and in total, and the bytes each host path moves.
// A GPU-updated host bucket's link work is its moments each way; its kernel's HBM traffic is as a
// device bucket's. The HBM total counts the device buckets only (the GPU path's kernels run
// behind its uploads).
struct StepWork {
  std::vector<Work> buckets;
  Work total;
  double cpu_link = 0;  // bytes the CPU path moves over each link
  double gpu_link = 0;  // bytes the GPU path moves over each link (its moments)
  double gpu_host = 0;  // bytes the GPU path moves through host memory (its moments both ways)
  double host_elements = 0, gpu_elements = 0;
  int64_t largest = 0;  // the largest GPU-updated parameter
};

void AddParamWork(const ParamRecord& rec, const Bandwidths& bw, const PlanOptions& options,
                  bool host, bool gpu, Work* w, StepWork* out) {
  const double bytes = static_cast<double>(rec.bytes);
  const double dev = static_cast<double>(DeviceUpdateTraffic(rec.numel, rec.dtype, options));
  if (!host) {
    w->hbm += dev / bw.hbm;
    return;
  }
  out->host_elements += static_cast<double>(rec.numel);
  if (gpu) {
    const double moments = static_cast<double>(DeviceUpdateLinkBytes(rec.numel, options));
    w->d2h += moments / bw.duplex;  // up and down at once
    w->h2d += moments / bw.duplex;
    w->hbm += dev / bw.hbm;
    out->gpu_link += moments;
    out->gpu_host += 2 * moments;
    out->gpu_elements += static_cast<double>(rec.numel);
    out->largest = std::max(out->largest, rec.numel);
  } else {
    const double host_bytes = static_cast<double>(HostMemoryTraffic(rec.numel, rec.dtype, options));
    w->d2h += bytes / bw.d2h;
    w->cpu += host_bytes / bw.host_update;
    w->h2d += bytes / bw.h2d;
    out->cpu_link += bytes;
  }
}

StepWork SumWork(const ProbeRecord& record, const Bandwidths& bw, const Plan& plan) {
  StepWork out;
  out.buckets.resize(plan.buckets.size());
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const Bucket& bucket = plan.buckets[b];
    Work& w = out.buckets[b];
    for (int64_t i : bucket.params) {
      AddParamWork(record.params[static_cast<size_t>(i)], bw, plan.options,
                   bucket.tier == Tier::kL2, bucket.device_update, &w, &out);
    }
    if (!bucket.device_update) out.total.hbm += w.hbm;
    out.total.d2h += w.d2h;
    out.total.cpu += w.cpu;
    out.total.h2d += w.h2d;
  }
  return out;
}

// Both host paths run through the step at once. The CPU path is bound by the host's memory,
// which also carries the GPU path's moments: its update runs at the rate the profile measured
// with copies running both ways, else takes as much longer as the moments add bytes.
double CpuSlowdown(const Bandwidths& bw, double cpu_host, double gpu_host) {
  if (gpu_host > 0 && bw.host_update_duplex > 0) {  // measured with the DMA running
    return std::max(1.0, bw.host_update / bw.host_update_duplex);
  }
  if (cpu_host > 0) return (cpu_host + gpu_host) / cpu_host;
  return 1.0;
}

// The CPU path's traffic in host memory slows the DMA as well: while the CPU path works (Tc), the
// links move at the rate the profile measured for copies both ways under the CPU update. Links
// busy L at the full rate then take L + Tc (1 - slow / fast), or L fast / slow if the CPU works
// throughout.
void StretchLinks(const Bandwidths& bw, double cpu_busy, StepWork* w) {
  const double links = std::max(w->total.d2h, w->total.h2d);
  if (!(w->total.cpu > 0 && links > 0 && bw.duplex_under_update < bw.duplex)) return;
  const double slow = bw.duplex_under_update / bw.duplex;
  const double stretch =
      cpu_busy * slow >= links ? 1.0 / slow : 1.0 + cpu_busy * (1.0 - slow) / links;
  for (Work& b : w->buckets) {
    b.d2h *= stretch;
    b.h2d *= stretch;
  }
  w->total.d2h *= stretch;
  w->total.h2d *= stretch;
}

// The framework under the host tier's load: the probe timed forward and backward alone (Pa) and
// under a saturating load (PL): emsa::HostLoad, the CPU update with copies both ways. What slows
// the threads launching the GPU's work is traffic in the host's memory, not busy cores. The
// load's share of the period is B / P: while the CPU path updates, the load is HostLoad's kind
// (its update with the DMA running), so B is at least the CPU path's time; the GPU path alone
// moves only its moments through host memory (DMA), so B is at least the time HostLoad would
// take to move the host tier's bytes of a step (the CPU path's update and DMA, the GPU path's
// moments both ways), and no more where the CPU's part is shorter.
// P = Pa + (PL - Pa) * min(1, B / P), solved for P (the right side falls as P grows, so there is
// one root: PL when B >= PL, else the positive root of P^2 - Pa P - (PL - Pa) B = 0). Every time
// in the probe's timeline stretches with it.
void ApplyHostLoad(const ProbeRecord& record, const Bandwidths& bw, const StepWork& w,
                   double cpu_busy, double cpu_host, Prediction* out) {
  out->load_slowdown = 1.0;
  const double alone = out->period;
  if (!(w.host_elements > 0 && alone > 0 && record.period_under_load > alone)) return;
  const double loaded = record.period_under_load;
  const double load_rate = (bw.host_update_duplex > 0 ? bw.host_update_duplex : bw.host_update) +
                           2 * bw.duplex_under_update;
  const double busy = std::max(cpu_busy, (cpu_host + w.gpu_host) / load_rate);
  const double p = busy >= loaded
                       ? loaded
                       : 0.5 * (alone + std::sqrt(alone * alone + 4 * (loaded - alone) * busy));
  out->load_slowdown = p / alone;
  out->period = p;
}

// An engine that takes, whenever free, of `list`'s buckets arrived by then (at[b]) the one the
// next forward needs first (the highest index), else idles until the next arrival; run(b, t)
// does b's work from t and returns when the engine is free again.
template <typename Run>
void Drain(size_t nb, const std::vector<size_t>& list, const std::vector<double>& at, Run&& run) {
  std::vector<char> done(nb, 0);
  double free = 0.0;
  for (size_t left = list.size(); left > 0; --left) {
    size_t pick = nb;
    double first = 0.0;
    for (size_t b : list) {
      if (done[b]) continue;
      if (at[b] <= free && (pick == nb || b > pick)) pick = b;
      if (pick == nb && (first == 0.0 || at[b] < first)) first = at[b];
    }
    if (pick == nb) {  // nothing arrived: idle until the next arrival
      free = first;
      for (size_t b : list) {
        if (!done[b] && at[b] <= free && (pick == nb || b > pick)) pick = b;
      }
    }
    done[pick] = 1;
    free = run(pick, free);
  }
}

// How long each host path's engines take over what they share. The CPU path's own copies, a small
// flow next to the moments, get an even share of a link while both use it; the GPU path's
// copies take as much longer as the CPU path's gradients and updates add bytes to the links.
struct Slowdowns {
  double cpu = 1.0;       // the CPU path's update
  double cpu_link = 1.0;  // the CPU path's copies
  double gpu_link = 1.0;  // the GPU path's moments
};

// When each bucket's update is done, as the host tier runs the engines (emsa/host_tier.h).
// Device buckets update in bucket order on the compute stream. Host buckets: gradients down in
// submission order (as each bucket is ready when gradients are released in backward; otherwise
// all at the end of backward, in forward order); the CPU takes, whenever free, the landed bucket
// the next forward needs first (the highest index), else waits for the next landing; uploads
// follow in CPU order. The GPU path (the streamer): each submitted bucket's moments up, then its
// kernel (the moments going back down trail by a staging slot and hold nothing up).
// Gated steps in backward (options.gated_steps): the verdict comes when backward ends (at the
// period), so neither path starts before it (the streamer's moments go up only then); the
// gradients still go down as they become final.
std::vector<double> FinishTimes(const Plan& plan, const StepWork& w, const Slowdowns& slow) {
  const PlanOptions& options = plan.options;
  const double period = plan.prediction.period, stretch = plan.prediction.load_slowdown;
  const bool gated = options.gated_steps && options.release_grads;
  const double release = gated ? period : 0.0;
  const size_t nb = plan.buckets.size();
  auto submitted = [&](size_t b) {
    return options.release_grads ? plan.buckets[b].ready_time * stretch : period;
  };
  std::vector<double> finish(nb, 0.0), landed(nb, 0.0), at(nb, 0.0);
  std::vector<size_t> host, gpu;  // CPU- and GPU-updated host buckets in submission order
  for (size_t b = 0; b < nb; ++b) {
    if (plan.buckets[b].tier == Tier::kL2)
      (plan.buckets[b].device_update ? gpu : host).push_back(b);
  }
  if (!options.release_grads) {
    std::reverse(host.begin(), host.end());
    std::reverse(gpu.begin(), gpu.end());
  }
  double hbm_free = 0, d2h_free = 0, h2d_free = 0;
  for (size_t b = 0; b < nb; ++b) {
    if (plan.buckets[b].tier == Tier::kL2) continue;
    hbm_free = std::max(plan.buckets[b].ready_time * stretch, hbm_free) + w.buckets[b].hbm;
    finish[b] = hbm_free;
  }
  for (size_t b : host) {
    d2h_free = std::max(submitted(b), d2h_free) + w.buckets[b].d2h * slow.cpu_link;
    landed[b] = std::max(d2h_free, release);
  }
  // The CPU path: each landed bucket updated, then uploaded.
  Drain(nb, host, landed, [&](size_t b, double t) {
    t += w.buckets[b].cpu * slow.cpu;
    h2d_free = std::max(t, h2d_free) + w.buckets[b].h2d * slow.cpu_link;
    finish[b] = h2d_free;
    return t;
  });
  for (size_t b : gpu) at[b] = std::max(submitted(b), release);
  Drain(nb, gpu, at, [&](size_t b, double t) {
    t += w.buckets[b].h2d * slow.gpu_link;
    finish[b] = t + w.buckets[b].hbm;
    return t;
  });
  return finish;
}

// The next forward needs param i at P + f_i: the worst lateness, floored at 0.
double Stall(const ProbeRecord& record, const Plan& plan, const std::vector<double>& finish) {
  const Prediction& out = plan.prediction;
  double stall = 0.0;
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    for (int64_t i : plan.buckets[b].params) {
      const double need =
          out.period +
          out.load_slowdown * ForwardNeed(record, record.params[static_cast<size_t>(i)]);
      stall = std::max(stall, finish[b] - need);
    }
  }
  return stall;
}

}  // namespace

void Predict(const ProbeRecord& record, const Bandwidths& bw, uint64_t base_device_bytes,
             Plan* plan) {
  Prediction& out = plan->prediction;
  out.period = Period(record);
  StepWork w = SumWork(record, bw, *plan);
  out.device_update_share = w.host_elements > 0 ? w.gpu_elements / w.host_elements : 0.0;
  out.stream_staging_bytes = 0;
  if (w.gpu_elements > 0) out.stream_staging_bytes = StreamStagingBytes(plan->options, w.largest);
  const double cpu_host = w.total.cpu * bw.host_update;
  Slowdowns slow;
  slow.cpu = CpuSlowdown(bw, cpu_host, w.gpu_host);
  StretchLinks(bw, w.total.cpu * slow.cpu, &w);
  out.hbm_time = w.total.hbm;
  out.d2h_time = w.total.d2h;
  out.cpu_time = w.total.cpu;
  out.h2d_time = w.total.h2d;
  slow.cpu_link = w.gpu_link > 0 ? 2.0 : 1.0;
  slow.gpu_link = w.gpu_link > 0 ? (w.cpu_link + w.gpu_link) / w.gpu_link : 1.0;
  ApplyHostLoad(record, bw, w, w.total.cpu * slow.cpu, cpu_host, &out);
  out.stall_time = Stall(record, *plan, FinishTimes(*plan, w, slow));
  out.step_time = out.period + out.stall_time;
  out.peak_device_bytes = base_device_bytes + out.device_state_bytes + out.stream_staging_bytes;
}

void PlanHostPaths(const ProbeRecord& record, const Bandwidths& bw, bool gpu_present,
                   uint64_t base_device_bytes, Plan* plan) {
  // Gated steps keep the share chosen for ungated ones, predicted as gated: choosing among the
  // gated predictions instead measured no faster (docs/decisions.md).
  if (plan->options.gated_steps) {
    plan->options.gated_steps = false;
    PlanHostPaths(record, bw, gpu_present, base_device_bytes, plan);
    plan->options.gated_steps = true;
    Predict(record, bw, base_device_bytes, plan);
    return;
  }
  const double asked = plan->options.device_update_share;
  ChooseDeviceUpdates(record, bw, gpu_present, asked, plan);
  Predict(record, bw, base_device_bytes, plan);
  if (asked >= 0 || !DeviceUpdatesAllowed(plan->options, gpu_present)) return;
  // The balanced share evens the engines' busy times, but the step is also the framework's
  // period, which the host tier's traffic stretches (the GPU path moves fewer host-memory bytes
  // per parameter than the CPU path). The grid's best prediction replaces it where it is
  // kShareGain shorter and predicts no stall: the engines' rates under each other's load are the
  // model's least certain part, so work moves to the GPU path only as far as the links keep up
  // with the period.
  constexpr int kGrid = 20;
  constexpr double kShareGain = 0.01, kNoStall = 0.01;
  const double balanced = plan->prediction.step_time;
  double best = balanced, best_share = asked;
  for (int k = 0; k <= kGrid; ++k) {
    const double share = static_cast<double>(k) / kGrid;
    ChooseDeviceUpdates(record, bw, gpu_present, share, plan);
    Predict(record, bw, base_device_bytes, plan);
    const Prediction& p = plan->prediction;
    if (p.stall_time <= kNoStall * p.period && p.step_time < best) {
      best = plan->prediction.step_time;
      best_share = share;
    }
  }
  if (best > balanced * (1 - kShareGain)) best_share = asked;
  ChooseDeviceUpdates(record, bw, gpu_present, best_share, plan);
  Predict(record, bw, base_device_bytes, plan);
}

}  // namespace emsa::plan_internal
