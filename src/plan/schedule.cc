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

void ChooseDeviceUpdates(const ProbeRecord& record, const Bandwidths& bw, bool gpu_present,
                         double asked, Plan* plan) {
  const PlanOptions& o = plan->options;
  // Over the host tier: host-memory and per-link bytes of what the CPU must update (fixed), and
  // of the eligible buckets on the CPU path (cpu_*) or the GPU path (gpu_*).
  double fixed_host = 0, fixed_link = 0, cpu_host = 0, cpu_link = 0, gpu_host = 0, gpu_link = 0;
  double eligible = 0;
  std::vector<double> elements(plan->buckets.size(), 0.0);  // > 0: an eligible bucket's size
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
      fixed_host += host;
      fixed_link += link;
      continue;
    }
    cpu_host += host;
    cpu_link += link;
    gpu_host += 2 * moments;
    gpu_link += moments;
    eligible += n;
    elements[b] = n;
  }
  double share = eligible > 0 ? asked : 0.0;  // none eligible unless allowed
  if (share < 0) {                            // the CPU path and the links busy equally long
    const double link_bw = bw.duplex;         // the moments go up and down at once
    // The CPU's rate with the DMA running, measured; else its rate alone, with the DMA's
    // moments charged to the host's memory in full.
    const bool measured = bw.host_update_duplex > 0;
    const double h = measured ? bw.host_update_duplex : bw.host_update;
    const double dma_host = measured ? 0.0 : gpu_host;
    const double gap = (fixed_host + cpu_host) / h - (fixed_link + cpu_link) / link_bw;
    const double slope = (cpu_host - dma_host) / h + (gpu_link - cpu_link) / link_bw;
    share = slope > 0 ? std::clamp(gap / slope, 0.0, 1.0) : (gap > 0 ? 1.0 : 0.0);
  }
  // Spread over the gradient-ready order, so both paths have work from the first gradients on:
  // each eligible bucket goes where the GPU's running share of the elements seen stays nearest
  // `share`.
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

void Predict(const ProbeRecord& record, const Bandwidths& bw, uint64_t base_device_bytes,
             Plan* plan) {
  const PlanOptions& options = plan->options;
  Prediction& out = plan->prediction;
  out.period = Period(record);

  // Per-bucket engine work in seconds at full bandwidth, and totals. A GPU-updated host bucket's
  // link work is its moments each way; its kernel's HBM traffic is as a device bucket's.
  struct Work {
    double hbm = 0, d2h = 0, cpu = 0, h2d = 0;
  };
  std::vector<Work> work(plan->buckets.size());
  double hbm = 0, d2h = 0, cpu = 0, h2d = 0;
  double cpu_link = 0, gpu_link = 0, gpu_host = 0, host_elements = 0, gpu_elements = 0;
  int64_t largest = 0;  // the largest GPU-updated parameter
  for (size_t b = 0; b < plan->buckets.size(); ++b) {
    const bool gpu = plan->buckets[b].device_update;
    for (int64_t i : plan->buckets[b].params) {
      const ParamRecord& rec = record.params[static_cast<size_t>(i)];
      const double bytes = static_cast<double>(rec.bytes);
      const double dev = static_cast<double>(DeviceUpdateTraffic(rec.numel, rec.dtype, options));
      if (plan->buckets[b].tier != Tier::kL2) {
        work[b].hbm += dev / bw.hbm;
        continue;
      }
      host_elements += static_cast<double>(rec.numel);
      if (gpu) {
        const double moments = static_cast<double>(DeviceUpdateLinkBytes(rec.numel, options));
        work[b].d2h += moments / bw.duplex;  // up and down at once
        work[b].h2d += moments / bw.duplex;
        work[b].hbm += dev / bw.hbm;
        gpu_link += moments;
        gpu_host += 2 * moments;
        gpu_elements += static_cast<double>(rec.numel);
        largest = std::max(largest, rec.numel);
      } else {
        const double host = static_cast<double>(HostMemoryTraffic(rec.numel, rec.dtype, options));
        work[b].d2h += bytes / bw.d2h;
        work[b].cpu += host / bw.host_update;
        work[b].h2d += bytes / bw.h2d;
        cpu_link += bytes;
      }
    }
    if (!gpu) hbm += work[b].hbm;
    d2h += work[b].d2h;
    cpu += work[b].cpu;
    h2d += work[b].h2d;
  }
  out.device_update_share = host_elements > 0 ? gpu_elements / host_elements : 0.0;
  out.stream_staging_bytes = 0;
  if (gpu_elements > 0) out.stream_staging_bytes = StreamStagingBytes(options, largest);
  // Both host paths run through the step at once. The CPU path is bound by the host's memory,
  // which also carries the GPU path's moments: its update runs at the rate the profile measured
  // with copies running both ways, else takes as much longer as the moments add bytes. The GPU path
  // is bound by the links, which also carry the CPU path's gradients and updates: its copies
  // take that much longer. The CPU path's own copies, a small flow next to the moments, get an
  // even share of a link while both use it.
  const double cpu_host = cpu * bw.host_update;
  double cpu_slowdown = 1.0;
  if (gpu_host > 0 && bw.host_update_duplex > 0) {  // measured with the DMA running
    cpu_slowdown = std::max(1.0, bw.host_update / bw.host_update_duplex);
  } else if (cpu_host > 0) {
    cpu_slowdown = (cpu_host + gpu_host) / cpu_host;
  }
  // The CPU path's traffic in host memory slows the DMA as well: while the CPU path works (Tc),
  // the links move at the rate the profile measured for copies both ways under the CPU update
  // (on the H200 host 33-35 GB/s each way, 50 without). Links busy L at the full rate then take
  // L + Tc (1 - slow / fast), or L fast / slow if the CPU works throughout.
  const double links = std::max(d2h, h2d);
  if (cpu > 0 && links > 0 && bw.duplex_under_update < bw.duplex) {
    const double slow = bw.duplex_under_update / bw.duplex, cpu_busy = cpu * cpu_slowdown;
    const double stretch =
        cpu_busy * slow >= links ? 1.0 / slow : 1.0 + cpu_busy * (1.0 - slow) / links;
    for (Work& w : work) {
      w.d2h *= stretch;
      w.h2d *= stretch;
    }
    d2h *= stretch;
    h2d *= stretch;
  }
  out.hbm_time = hbm;
  out.d2h_time = d2h;
  out.cpu_time = cpu;
  out.h2d_time = h2d;
  const double cpu_link_slowdown = gpu_link > 0 ? 2.0 : 1.0;
  const double gpu_link_slowdown = gpu_link > 0 ? (cpu_link + gpu_link) / gpu_link : 1.0;

  // The framework under the host tier's load: the probe timed forward and backward alone (Pa)
  // and under a saturating load (PL): emsa::HostLoad, the CPU update with copies both ways.
  // What slows the threads launching the GPU's work is traffic in the host's memory (busy cores
  // alone cost little, measured). The load's share of the period is B / P: while the CPU path
  // updates, the load is HostLoad's kind (its update with the DMA running), so B is at least
  // the CPU path's time; the GPU path alone moves only its moments through host memory (DMA),
  // so B is at least the time HostLoad would take to move the host tier's bytes of a step (the
  // CPU path's update and DMA, the GPU path's moments both ways), and no more where the CPU's
  // part is shorter (on the H200 host, a 0.95 B Llama with half its state on the host, all of it
  // GPU-updated, ran a 4 x 512 step in 91-93 ms: the links' busy time, 80 ms, predicted 107, its
  // bytes 83-89).
  // P = Pa + (PL - Pa) * min(1, B / P), solved for P (the right side falls as P grows, so there
  // is one root: PL when B >= PL, else the positive root of P^2 - Pa P - (PL - Pa) B = 0).
  // Every time in the probe's timeline stretches with it.
  out.load_slowdown = 1.0;
  const double alone = out.period;
  if (host_elements > 0 && alone > 0 && record.period_under_load > alone) {
    const double loaded = record.period_under_load;
    const double load_rate = (bw.host_update_duplex > 0 ? bw.host_update_duplex : bw.host_update) +
                             2 * bw.duplex_under_update;
    const double busy = std::max(cpu * cpu_slowdown, (cpu_host + gpu_host) / load_rate);
    const double p = busy >= loaded
                         ? loaded
                         : 0.5 * (alone + std::sqrt(alone * alone + 4 * (loaded - alone) * busy));
    out.load_slowdown = p / alone;
    out.period = p;
  }
  const double stretch = out.load_slowdown;

  // The engines as the host tier runs them (emsa/host_tier.h). Device buckets update in bucket
  // order on the compute stream. Host buckets: gradients down in submission order (as each
  // bucket is ready when gradients are released in backward; otherwise all at the end of
  // backward, in forward order); the CPU takes, whenever free, the landed bucket the next
  // forward needs first (the highest index), else waits for the next landing; uploads follow
  // in CPU order.
  const size_t nb = plan->buckets.size();
  std::vector<double> finish(nb, 0.0), landed(nb, 0.0);
  std::vector<size_t> host, gpu;  // CPU- and GPU-updated host buckets in submission order
  for (size_t b = 0; b < nb; ++b) {
    if (plan->buckets[b].tier == Tier::kL2) {
      (plan->buckets[b].device_update ? gpu : host).push_back(b);
    }
  }
  if (!options.release_grads) {
    std::reverse(host.begin(), host.end());
    std::reverse(gpu.begin(), gpu.end());
  }
  double hbm_free = 0, d2h_free = 0, h2d_free = 0;
  for (size_t b = 0; b < nb; ++b) {
    if (plan->buckets[b].tier == Tier::kL2) continue;
    hbm_free = std::max(plan->buckets[b].ready_time * stretch, hbm_free) + work[b].hbm;
    finish[b] = hbm_free;
  }
  for (size_t b : host) {
    const double ready = options.release_grads ? plan->buckets[b].ready_time * stretch : out.period;
    d2h_free = std::max(ready, d2h_free) + work[b].d2h * cpu_link_slowdown;
    landed[b] = d2h_free;
  }
  // An engine that takes, whenever free, of `list`'s buckets arrived by then (at[b]) the one the
  // next forward needs first (the highest index), else idles until the next arrival; run(b, t)
  // does b's work from t and returns when the engine is free again.
  auto drain = [nb](const std::vector<size_t>& list, const std::vector<double>& at, auto&& run) {
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
  };
  // The CPU path: each landed bucket updated, then uploaded.
  drain(host, landed, [&](size_t b, double t) {
    t += work[b].cpu * cpu_slowdown;
    h2d_free = std::max(t, h2d_free) + work[b].h2d * cpu_link_slowdown;
    finish[b] = h2d_free;
    return t;
  });
  // The GPU path (the streamer): each submitted bucket's moments up, then its kernel (the moments
  // going back down trail by a staging slot and hold nothing up).
  std::vector<double> submitted(nb, 0.0);
  for (size_t b : gpu) {
    submitted[b] = options.release_grads ? plan->buckets[b].ready_time * stretch : out.period;
  }
  drain(gpu, submitted, [&](size_t b, double t) {
    t += work[b].h2d * gpu_link_slowdown;
    finish[b] = t + work[b].hbm;
    return t;
  });
  double stall = 0.0;
  for (size_t b = 0; b < nb; ++b) {
    for (int64_t i : plan->buckets[b].params) {
      const double need =
          out.period + stretch * ForwardNeed(record, record.params[static_cast<size_t>(i)]);
      stall = std::max(stall, finish[b] - need);
    }
  }
  out.stall_time = stall;
  out.step_time = out.period + stall;
  out.peak_device_bytes = base_device_bytes + out.device_state_bytes + out.stream_staging_bytes;
}

void PlanHostPaths(const ProbeRecord& record, const Bandwidths& bw, bool gpu_present,
                   uint64_t base_device_bytes, Plan* plan) {
  const double asked = plan->options.device_update_share;
  ChooseDeviceUpdates(record, bw, gpu_present, asked, plan);
  Predict(record, bw, base_device_bytes, plan);
  if (asked >= 0 || !DeviceUpdatesAllowed(plan->options, gpu_present)) return;
  // The balanced share evens the engines' busy times, but the step is also the framework's
  // period, which the host tier's traffic stretches (the GPU path moves fewer host-memory bytes
  // per parameter than the CPU path). The grid's best prediction replaces it where it is
  // kShareGain shorter and predicts no stall: the engines' rates under each other's load are the
  // model's least certain part (on the H200 host, all state on the host, the GPU updating all
  // was predicted faster than 0.6 of it and measured 7% slower, 171 against 160 ms), so work
  // moves to the GPU path only as far as the links keep up with the period.
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
