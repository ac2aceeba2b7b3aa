// The alpha-beta cost model: least-squares fits, ring-model coefficients of a described cluster,
// the pipelined SAA pair, and the pricing of step lists.
#include <algorithm>
#include <cmath>
#include <limits>

#include "uniep/parm.hpp"
#include "uniep/status.hpp"

namespace uniep::parm {

AlphaBetaFit fit_alpha_beta(const std::vector<double>& sizes, const std::vector<double>& seconds) {
  UNIEP_CHECK(sizes.size() == seconds.size(), "sizes and seconds must have the same length, got ",
              sizes.size(), " and ", seconds.size());
  const size_t n = sizes.size();
  UNIEP_CHECK(n >= 2, "fit_alpha_beta needs at least two samples, got ", n);
  double mean_n = 0, mean_t = 0;
  for (size_t i = 0; i < n; ++i) {
    UNIEP_CHECK(std::isfinite(sizes[i]) && std::isfinite(seconds[i]),
                "sizes and seconds must be finite (sample ", i, ")");
    mean_n += sizes[i];
    mean_t += seconds[i];
  }
  mean_n /= n;
  mean_t /= n;
  double sxx = 0, sxy = 0, syy = 0;
  for (size_t i = 0; i < n; ++i) {
    const double dx = sizes[i] - mean_n, dy = seconds[i] - mean_t;
    sxx += dx * dx;
    sxy += dx * dy;
    syy += dy * dy;
  }
  UNIEP_CHECK(sxx > 0, "sizes must hold at least two distinct values");
  AlphaBetaFit fit;
  fit.samples = static_cast<int64_t>(n);
  fit.coeffs.beta = sxy / sxx;
  fit.coeffs.alpha = mean_t - fit.coeffs.beta * mean_n;
  double ss_res = 0;
  for (size_t i = 0; i < n; ++i) {
    const double r = seconds[i] - fit.coeffs.at(sizes[i]);
    ss_res += r * r;
  }
  fit.r2 = syy > 0 ? 1.0 - ss_res / syy : (ss_res == 0 ? 1.0 : 0.0);
  return fit;
}

double CostModel::compute_seconds(double flops, double mem_bytes) const {
  if (flops <= 0 && mem_bytes <= 0) return 0;
  return std::max(gemm.at(flops), gemm.alpha + mem_beta * mem_bytes);
}

double CostModel::comm_seconds(Collective c, LinkClass link, double bytes) const {
  if (c == Collective::kNone || link == LinkClass::kLocal) return 0;
  return comm[collective_index(c)][link == LinkClass::kInter ? 1 : 0].at(bytes);
}

CostModel cost_model_from_cluster(const ClusterSpec& spec, const RankLayout& layout) {
  UNIEP_CHECK(spec.intra_bw > 0 && spec.inter_bw > 0, "cluster bandwidths must be > 0");
  UNIEP_CHECK(spec.peak_flops > 0 && spec.mem_bw > 0, "cluster peak_flops and mem_bw must be > 0");
  CostModel m;
  const double alpha[2] = {spec.intra_alpha, spec.inter_alpha};
  const double bw[2] = {spec.intra_bw, spec.inter_bw};
  // All-gather, reduce-scatter and all-reduce run over the MP/ESP group; the all-to-all over EP.
  const double N = static_cast<double>(layout.mp_size), G = static_cast<double>(layout.ep_size);
  for (int l = 0; l < 2; ++l) {
    const double ring = N > 1 ? (N - 1) / N : 0;
    m.comm[collective_index(Collective::kAllGather)][l] = {(N - 1) * alpha[l], ring / bw[l]};
    m.comm[collective_index(Collective::kReduceScatter)][l] = {(N - 1) * alpha[l], ring / bw[l]};
    m.comm[collective_index(Collective::kAllReduce)][l] = {2 * (N - 1) * alpha[l],
                                                           2 * ring / bw[l]};
  }
  // The EP all-to-all sends each peer 1/G of its buffer. Its inter-node blocks bound its time when
  // some peer is off the node (the on-node blocks go over the faster links at the same time).
  const double a2a_intra = G > 1 ? (G - 1) / G : 0;
  m.comm[collective_index(Collective::kAllToAll)][0] = {(G - 1) * spec.intra_alpha,
                                                        a2a_intra / spec.intra_bw};
  const double off = layout.ep_peers_inter > 0 ? layout.ep_peers_inter / G : a2a_intra;
  m.comm[collective_index(Collective::kAllToAll)][1] = {(G - 1) * spec.inter_alpha,
                                                        off / spec.inter_bw};
  m.gemm = {spec.kernel_alpha, 1.0 / spec.peak_flops};
  m.mem_beta = 1.0 / spec.mem_bw;
  return m;
}

double saa_seconds(const AlphaBeta& a2a, double a2a_bytes, const AlphaBeta& ag, double ag_bytes,
                   int64_t max_chunks, int64_t* best_chunks) {
  double best = std::numeric_limits<double>::infinity();
  int64_t best_r = 1;
  const int64_t most = std::max<int64_t>(1, max_chunks);
  for (int64_t r = 1;; r *= 2) {
    const double ta = a2a.at(a2a_bytes / r), tg = ag.at(ag_bytes / r);
    // The first chunk's all-to-all and the last chunk's all-gather have no partner.
    const double t = ta + (r - 1) * std::max(ta, tg) + tg;
    if (t < best) {
      best = t;
      best_r = r;
    }
    // Stop before r * 2 passes max_chunks, or INT64_MAX (where r *= 2 would wrap to a negative r
    // that is always <= max_chunks, and the loop would never end).
    if (r > most / 2) break;
  }
  if (best_chunks != nullptr) *best_chunks = best_r;
  return best;
}

Pricing price(const StepList& list, const CostModel& model) {
  Pricing p;
  p.step_seconds.assign(list.steps.size(), 0.0);
  p.chunks.assign(list.steps.size(), 1);
  const int64_t n = static_cast<int64_t>(list.steps.size());
  // A pair links both ways; a dangling or one-sided link would index past the list or price a
  // step twice.
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = list.steps[i].overlap_with;
    if (j == -1) continue;
    UNIEP_CHECK(j >= 0 && j < n && j != i, "steps[", i,
                "].overlap_with must be -1 or the index of another step in [0, ", n, "), got ", j);
    UNIEP_CHECK(list.steps[j].overlap_with == i, "steps[", i, "].overlap_with is ", j,
                " but steps[", j, "].overlap_with is ", list.steps[j].overlap_with,
                ": a pipelined pair must name each other");
  }
  for (size_t i = 0; i < list.steps.size(); ++i) {
    const Step& s = list.steps[i];
    if (s.overlap_with >= 0 && s.overlap_with < static_cast<int64_t>(i)) continue;  // priced
    double t = 0;
    if (s.overlap_with >= 0) {
      const Step& g = list.steps[s.overlap_with];
      if (s.link == LinkClass::kLocal || g.link == LinkClass::kLocal) {
        // One side moves nothing (a group of one): no pipeline to speak of.
        t = model.comm_seconds(s.collective, s.link, s.bytes) +
            model.comm_seconds(g.collective, g.link, g.bytes);
      } else {
        const auto& ca = model.comm[collective_index(s.collective)][s.link == LinkClass::kInter];
        const auto& cg = model.comm[collective_index(g.collective)][g.link == LinkClass::kInter];
        int64_t r = 1;
        t = saa_seconds(ca, s.bytes, cg, g.bytes, model.max_chunks, &r);
        p.chunks[i] = p.chunks[s.overlap_with] = r;
      }
    } else if (s.collective != Collective::kNone) {
      t = model.comm_seconds(s.collective, s.link, s.bytes);
    } else {
      t = model.compute_seconds(s.flops, s.mem_bytes);
    }
    t += model.step_alpha * (s.overlap_with >= 0 ? 2 : 1);
    p.step_seconds[i] = t;
    p.seconds += t;
  }
  return p;
}

Choice choose(const ParmShape& shape, const CostModel& model) {
  Choice c;
  const Schedule all[3] = {Schedule::kBaseline, Schedule::kS1, Schedule::kS2};
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < 3; ++i) {
    ScheduleCost& sc = c.costs[i];
    sc.schedule = all[i];
    sc.forward = price(build_steps(shape, all[i], Pass::kForward), model).seconds;
    sc.backward = price(build_steps(shape, all[i], Pass::kBackward), model).seconds;
    if (sc.total() < best) {
      best = sc.total();
      c.best = all[i];
    }
  }
  return c;
}

}  // namespace uniep::parm
