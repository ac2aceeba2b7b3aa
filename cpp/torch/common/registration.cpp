// The torch.ops.uniep schemas. Implementations live per dispatch key, in each engine's folder
// (cpu_ops.cpp, cuda_ops.cpp, *_ops.cpp); fake kernels and autograd are registered from Python
// (uniep/moe/ops.py).
#include <torch/library.h>

TORCH_LIBRARY(uniep, m) {
  m.def(
      "moe_forward(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w1, Tensor w2, "
      "str group_name, str tuning=\"\") -> Tensor");
  m.def(
      "moe_backward(Tensor grad_out, Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w1, "
      "Tensor w2, str group_name, str tuning=\"\") -> (Tensor, Tensor, Tensor, Tensor)");
  // The checks of moe_backward's CUDA implementation (composed in Python) and their agreement
  // with the peers; CUDA only.
  m.def(
      "moe_backward_checks(Tensor grad_out, Tensor x, Tensor topk_idx, Tensor topk_weights, "
      "Tensor w1, Tensor w2, str group_name, str tuning=\"\") -> ()");
  // moe_backward's engine part on CUDA (tuning gemm=uniep; its checks included): grad_x, each
  // expert row's routing-weight gradient and combine target, and the weights' gradients.
  m.def(
      "moe_backward_engine(Tensor grad_out, Tensor x, Tensor topk_idx, Tensor topk_weights, "
      "Tensor w1, Tensor w2, str group_name, str tuning=\"\") -> (Tensor grad_x, "
      "Tensor row_dots, Tensor row_target, Tensor grad_w1, Tensor grad_w2)");
  // torch._grouped_mm's bf16 case on UniEP's Hopper grouped GEMM (CUDA only): x [R, K],
  // w [E, K, N], offs [E] int32 cumulative row ends -> [R, N]; expert e multiplies rows
  // [offs[e-1], offs[e]) of x by w[e]. offs stays on the device (no host sync). tuning's
  // tile_m, tile_n, tile_k and stages pick the configuration (all auto: by shape). w may be the
  // transpose of a contiguous [E, N, K] (read K-major, no copy). out_dtype float32: the
  // accumulator as is instead of rounded to bf16 (w is then read as [E, K, N], copied if need be).
  m.def(
      "grouped_mm(Tensor x, Tensor w, Tensor offs, str tuning=\"\", ScalarType? out_dtype=None) "
      "-> Tensor");
  // The same with SwiGLU applied in the GEMM's epilogue (CUDA only): w_packed [E, K, 2I] holds
  // gate and up interleaved in blocks of 8 columns (uniep.gemm.pack_gate_up) -> act [R, I].
  m.def("grouped_mm_swiglu(Tensor x, Tensor w_packed, Tensor offs, str tuning=\"\") -> Tensor");
  // The same activation, bit for bit, from w1 [E, K, 2I] as stored (gate columns, then up; I a
  // multiple of 64), with no packed copy (CUDA only).
  m.def("grouped_mm_swiglu_plain(Tensor x, Tensor w1, Tensor offs, str tuning=\"\") -> Tensor");
  // The backward's grouped products (CUDA only): dgrad dy [R, N] x w[e]^T for w [E, K, N] ->
  // [R, K]; wgrad x[rows of e]^T x dy[rows of e] for x [R, K], dy [R, N] -> [E, K, N] (E =
  // offs.size(0); zeros for an expert with no rows), summed over rows in ascending order.
  m.def("grouped_mm_dgrad(Tensor dy, Tensor w, Tensor offs, str tuning=\"\") -> Tensor");
  m.def("grouped_mm_wgrad(Tensor x, Tensor dy, Tensor offs, str tuning=\"\") -> Tensor");
  // The forward in fp8 (CUDA only): x [R, K] e4m3 with x_scales [R, K / 128], w [E, N, K] e4m3
  // (K-major) with w_scales [E, K / 128, N / 128] -> bf16 [R, N] (uniep.gemm.quantize_rows,
  // quantize_expert_weights), or float32 with out_dtype float32 (the accumulator as is); the
  // tuning string's tile keys pick among the fp8 configurations.
  m.def(
      "grouped_mm_fp8(Tensor x, Tensor x_scales, Tensor w, Tensor w_scales, Tensor offs, "
      "str tuning=\"\", ScalarType? out_dtype=None) -> Tensor");
  // The activation between the fp8 GEMMs: h [R, 2I] bf16 -> SwiGLU rounded to bf16, quantized
  // as the fp8 dispatch quantizes a row: (e4m3 [R, I], fp32 scales [R, I / 128]). CUDA in one
  // pass; the CPU kernel (uniep/gemm.py) is the same arithmetic in torch.
  m.def("swiglu_fp8(Tensor h) -> (Tensor act, Tensor scales)");
  // Expert weights in the fp8 experts' format, on any device (uniep.gemm's functions of the same
  // names; include/uniep/fp8_weights.hpp has the host versions): w [E, K, N] -> (e4m3 [E, N, K],
  // fp32 scales [E, K / 128, N / 128]); w1's q1 [E, 2I, K] and s1 [E, K / 128, 2I / 128] -> the
  // rows in blocks of 64 (gate, up) and a scale per 64 rows, as grouped_mm_fp8_swiglu reads them,
  // and back.
  m.def("quantize_expert_weights(Tensor w) -> (Tensor q, Tensor scales)");
  m.def("pack_gate_up_fp8(Tensor q1, Tensor s1) -> (Tensor q, Tensor scales)");
  m.def("unpack_gate_up_fp8(Tensor q_packed, Tensor s_packed) -> (Tensor q1, Tensor scales)");
  // The first fp8 expert GEMM with SwiGLU in its epilogue (CUDA only): w_packed [E, 2I, K] and
  // w_scales [E, K / 128, 2I / 64] from uniep.gemm.pack_gate_up_fp8 -> the activation [R, I]
  // bf16, the bits of grouped_mm_fp8 on the unpacked weights followed by SwiGLU rounded to bf16.
  m.def(
      "grouped_mm_fp8_swiglu(Tensor x, Tensor x_scales, Tensor w_packed, Tensor w_scales, "
      "Tensor offs, str tuning=\"\") -> Tensor");
  // Rows in the fp8 dispatch's format: x [R, K] bf16 -> (e4m3 [R, K], fp32 scales [R, K / 128]),
  // the bytes of the dispatch's and the activation's encoding (CUDA in one pass; the CPU kernel,
  // in uniep/gemm, the same divisions in torch).
  m.def("quantize_fp8(Tensor x) -> (Tensor q, Tensor scales)");
  // quantize_fp8 of tokens x [T, K] stored at their GEMM rows gemm_row [T, top_k] (a plan's,
  // -1: none) -> (rows [T * top_k, K] e4m3, scales [T * top_k, K / 128] fp32, error [1] int64):
  // rows no entry names hold no particular bytes; an entry whose row is >= T * top_k is left out
  // and recorded in error (uniep/send_rows_error.hpp's word). report=False: such an entry is
  // left out unrecorded and error is empty ([0]; the caller's plan vouches for the rows).
  m.def(
      "quantize_fp8_rows(Tensor x, Tensor gemm_row, bool report=True) -> "
      "(Tensor rows, Tensor scales, Tensor error)");
  // The element-wise steps of moe_backward's experts on CUDA (uniep/cuda/grouped_gemm.hpp),
  // bf16 rows: SwiGLU's backward (h [R, 2I], grad_act [R, I] -> act [R, I], grad_h [R, 2I]),
  // rows scaled by an fp32 weight each, and fp32 row dot products.
  // The MegaKernel's tile gates on their own (CUDA only; include/uniep/cuda/tile_gate.hpp):
  // gate_tile_base(offs, rows, tile_m) -> [E + 1] int32, the first counter of each expert's
  // tiles; grouped_mm_gated runs grouped_mm's forward (swiglu: grouped_mm_swiglu's) on the
  // 128 x 256 cooperative tiles with the producer waiting, before each tile, until
  // counters[tile_base[e] + i] >= per_row * rows_in_tile + per_tile; with `done`, each finished
  // tile's warps add 1 to done[tile_base[e] + i]. Writes `out` ([R, N], or [R, N / 2] with
  // swiglu) and returns timeout [5] int32: flag, expert, m_tile, have, need of the first wait
  // that passed timeout_s (uniep.moe.tile_gates.check_gate_timeout). w1_as_stored (with swiglu): w
  // is w1 as stored (gate columns, then up; the FFN size a multiple of 128), not pack_gate_up's.
  m.def("gate_tile_base(Tensor offs, int rows, int tile_m) -> Tensor");
  m.def(
      "grouped_mm_gated(Tensor x, Tensor w, Tensor offs, Tensor counters, Tensor tile_base, "
      "int per_row, int per_tile, float timeout_s, bool swiglu, Tensor(a!)? done, "
      "int sm_count, Tensor(b!) out, bool w1_as_stored=False) -> Tensor timeout");
  // The MegaKernel's dispatch on its own (include/uniep/cuda/send_rows.hpp; CPU and CUDA):
  // sender_rows(topk_idx [T, K], expert_counts [W, E], rank, tile_m) -> dest_rank, gemm_row,
  // counter ([T, K] int64: each entry's rank, grouped-GEMM row there and tile gate counter
  // there, -1 unused) and error [1] int64; send_rows (world 1: this rank's own rows) stores
  // row x[t] at rows[gemm_row[t, k]] and adds 1 to counters[counter[t, k]] for every entry,
  // returning error [1] int64. A failing entry is skipped and recorded in error
  // (uniep.moe.tile_gates.check_send_error).
  m.def(
      "sender_rows(Tensor topk_idx, Tensor expert_counts, int rank, int tile_m) -> "
      "(Tensor dest_rank, Tensor gemm_row, Tensor counter, Tensor error)");
  // expert_tiles(topk_idx [T, K], num_experts, tile_m) -> counts [E] int64 (entries routed to
  // each expert; ids < 0 or >= E count nowhere), offs [E] int32 (their inclusive sums, the
  // grouped GEMM's row ends) and tile_base [E + 1] int32 (gate_tile_base(offs, T * K, tile_m)):
  // the local MegaKernel's plan before sender_rows; on CUDA a memset and one launch.
  m.def(
      "expert_tiles(Tensor topk_idx, int num_experts, int tile_m) -> "
      "(Tensor counts, Tensor offs, Tensor tile_base)");
  // local_plan(topk_idx [T, K], num_experts, tile_m) -> expert_tiles' three outputs, then
  // sender_rows(topk_idx, counts [1, E], 0, tile_m)'s four: the whole plan of a world-1 call
  // (on CUDA a memset and two launches up to 1,024 experts; uniep/cuda/send_rows.hpp).
  m.def(
      "local_plan(Tensor topk_idx, int num_experts, int tile_m) -> "
      "(Tensor counts, Tensor offs, Tensor tile_base, Tensor dest_rank, Tensor gemm_row, "
      "Tensor counter, Tensor error)");
  // send_order(topk_idx [T, K], expert_counts [W, E], rank) -> [T * K] int64: the plan's order
  // of this rank's entries for a send that overlaps the GEMMs (uniep::SenderRows::send_order).
  m.def("send_order(Tensor topk_idx, Tensor expert_counts, int rank) -> Tensor");
  m.def(
      "send_rows(Tensor x, Tensor dest_rank, Tensor gemm_row, Tensor counter, Tensor(a!) rows, "
      "Tensor(b!) counters, int sm_count) -> Tensor error");
  // keep_first_errors(sticky, words): each sticky[i] takes words[i] where its first element is 0
  // (the first error of any call kept; include/uniep/cuda/error_words.hpp), one launch on CUDA.
  m.def("keep_first_errors(Tensor(a!)[] sticky, Tensor[] words) -> ()");
  // combine_rows(y [R, H] bf16, gemm_row [T, K], topk_weights [T, K] fp32) -> out [T, H], error:
  // out[t] = sum_k w[t, k] * y[gemm_row[t, k]] (k ascending, fp32, the combines' rounding); an
  // entry whose row is >= R is skipped and recorded in error [1]. report=False: skipped
  // unrecorded and error is empty ([0]; the caller's plan vouches for the rows).
  m.def(
      "combine_rows(Tensor y, Tensor gemm_row, Tensor topk_weights, bool report=True) -> "
      "(Tensor out, Tensor error)");
  // The MegaKernel's forward at world 1 (CUDA only; include/uniep/cuda/fused_moe.hpp): one
  // persistent launch of the send into GEMM rows (gemm_row / counter from sender_rows), both
  // expert GEMMs (w1_packed: pack_gate_up's layout, or w1 as stored, gate columns then up,
  // with w1_as_stored: ffn a multiple of 128) and the reduce over k. Returns out [T, H],
  // error [1] int64 (uniep.moe.tile_gates.check_send_error) and timeout [5] int32
  // (uniep.moe.tile_gates.check_gate_timeout), to be read once the stream has run. trace (int64, 4
  // per SM): each CTA's global-timer stamps at its start, after its send, its GEMMs and its reduce.
  m.def(
      "moe_fused_local(Tensor x, Tensor topk_weights, Tensor gemm_row, Tensor counter, "
      "Tensor w1_packed, Tensor w2, Tensor offs, Tensor tile_base, int comm_ctas, "
      "int skip_rounds, float timeout_s, Tensor(a!)? trace=None, int tile_m=128, "
      "bool w1_as_stored=False, int tile_n=0) -> "
      "(Tensor out, Tensor error, Tensor timeout)");
  // The same with the routing's plan made in the launch (include/uniep/cuda/fused_moe.hpp,
  // moe_fused_forward_planned_bf16): topk_idx [T, K] int64 instead of local_plan's outputs, at
  // most 4,096 entries (T x K) and 1,024 experts; every CTA sends. The same bits and returns.
  m.def(
      "moe_fused_local_planned(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w1_packed, "
      "Tensor w2, float timeout_s, int tile_m=128, bool w1_as_stored=False, int tile_n=0) -> "
      "(Tensor out, Tensor error, Tensor timeout)");
  // The MegaKernel backward's first launch at world 1 (CUDA only;
  // include/uniep/cuda/fused_moe_backward.hpp): the send of x's and grad_out's rows into GEMM rows
  // (the forward's plan at 128-row tiles) and h = rows_x w1, grad_act = rows_go w2t as one gated
  // grouped GEMM (w1 [E, H, 2I], w2t [E, H, I] = w2 transposed). Returns rows_x, rows_go [T K, H],
  // h [T K, 2I], grad_act [T K, I] (rows past offs[-1] unwritten), error [1] int64 and
  // timeout [5] int32, to be read once the stream has run. trace (int64, 4 per SM): each CTA's
  // global-timer stamps at its start, after its send and after its GEMM tiles.
  m.def(
      "moe_fused_backward_local(Tensor grad_out, Tensor x, Tensor gemm_row, Tensor counter, "
      "Tensor w1, Tensor w2t, Tensor offs, Tensor tile_base, float timeout_s, "
      "Tensor(a!)? trace=None) -> "
      "(Tensor rows_x, Tensor rows_go, Tensor h, Tensor grad_act, Tensor error, Tensor timeout)");
  // The same across the ranks of a group (CUDA only; include/uniep/cuda/fused_ep.hpp), on the
  // group's fused runtime (uniep.moe.megakernel.launch.init_fused_ep): x [T, H] bf16, topk_idx [T,
  // K] int64 (global expert ids), topk_weights [T, K] fp32, this rank's experts' w1_packed / w2
  // (w1_as_stored as moe_fused_local's). Every
  // rank calls it in the same order. Returns out, error and timeout as moe_fused_local does.
  m.def(
      "moe_fused_ep(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w1_packed, "
      "Tensor w2, str group_name, int comm_ctas, int skip_rounds, Tensor(a!)? trace=None, "
      "bool w1_as_stored=False, int tile_n=0) -> "
      "(Tensor out, Tensor error, Tensor timeout)");
  // Its backward on the same routing (CUDA only; fused_ep.hpp's backward_rows and
  // backward_return, on a runtime created with backward=True): grad_out [T, H] bf16, the
  // forward's x, topk_idx and topk_weights, this rank's experts' w1 [E / W, H, 2I] (gate, then
  // up) and w2t [E / W, H, I] (w2 transposed). Returns grad_x [T, H], grad_topk_weights [T, K]
  // fp32, grad_w1, grad_w2, error and timeout (read once the stream has run).
  m.def(
      "moe_fused_ep_backward(Tensor grad_out, Tensor x, Tensor topk_idx, Tensor topk_weights, "
      "Tensor w1, Tensor w2t, str group_name, Tensor(a!)? trace=None) -> "
      "(Tensor grad_x, Tensor grad_w, Tensor grad_w1, Tensor grad_w2, Tensor error, "
      "Tensor timeout)");
  // The experts' backward between its grouped GEMMs (CUDA only;
  // include/uniep/cuda/grouped_gemm.hpp's swiglu_backward_bf16): h [R, 2I] bf16, grad_act [R, I]
  // bf16 (before the routing weight), w [R] fp32 -> act * w, grad_h, dots [R] fp32.
  m.def(
      "swiglu_backward(Tensor h, Tensor grad_act, Tensor w) -> (Tensor act_w, Tensor grad_h, "
      "Tensor dots)");
  m.def(
      "routing_layout(Tensor topk_idx, int num_experts, int world_size) -> "
      "(Tensor tokens_per_rank, Tensor tokens_per_expert, Tensor token_in_rank)");
  // The grouped-GEMM row lists of received slots (what ep_dispatch returns for its own round):
  // rows of local expert e are [offsets[e], offsets[e + 1]) of the cumulative tokens_per_expert.
  m.def(
      "expert_rows(Tensor recv_src, Tensor recv_topk_idx, Tensor recv_from_rank, int rank, "
      "int num_experts, int max_tokens) -> (Tensor row_slot, Tensor row_target, "
      "Tensor tokens_per_expert)");
  // Expert-parallel dispatch/combine on the GPU runtime of the group (uniep.moe.ep.init_runtime).
  // Slots are ordered by (source rank, source token); row_slot/row_target describe the grouped-GEMM
  // rows.
  m.def(
      "ep_dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, str group_name, "
      "str tuning=\"\") -> (Tensor recv_x, Tensor recv_scales, Tensor recv_src, "
      "Tensor recv_topk_idx, Tensor recv_topk_weights, Tensor tokens_per_expert, "
      "Tensor row_slot, Tensor row_target, int epoch)");
  // The rows of x on the plan of an earlier ep_dispatch (same routing; `epoch` from its
  // handle): no count exchange and no host sync. Returns the rows and the new round's epoch.
  m.def(
      "ep_dispatch_cached(Tensor x, Tensor topk_idx, Tensor topk_weights, str group_name, "
      "int epoch, str tuning=\"\") -> (Tensor recv_x, Tensor recv_scales, int epoch)");
  m.def(
      "ep_combine(Tensor y, Tensor row_target, Tensor topk_idx, Tensor topk_weights, "
      "str group_name, int epoch, str tuning=\"\") -> Tensor");
  // Low-latency mode: fixed regions per (local expert, source), no host sync, graph-capturable.
  // The outputs are views of the runtime's buffer `buffer`, valid until its next ll_dispatch.
  m.def(
      "ll_dispatch(Tensor x, Tensor topk_idx, str group_name, int buffer=0) -> "
      "(Tensor recv_x, Tensor recv_count, Tensor recv_slot)");
  m.def(
      "ll_combine(Tensor y, Tensor topk_idx, Tensor topk_weights, str group_name, "
      "int buffer=0) -> Tensor");
  // Parm (MP+EP+ESP, include/uniep/parm.hpp): one MoE layer under one schedule ("baseline", "s1",
  // "s2"). Besides y and l_aux it returns what the backward needs: the expert input and the
  // combine input of this rank, and stats = [top-1 counts of the MP group (E), dropped pairs,
  // largest (slice, expert) demand, slice capacity] (float64). chunks: the plan's SAA chunk
  // counts, one per step of the forward list then of the backward list (Pricing::chunks of
  // each); [] leaves every pair to the executor's default. CPU: uniep/parm/ops.py.
  m.def(
      "parm_moe_forward(Tensor x, Tensor gate, Tensor w1, Tensor w2, str mp_group, "
      "str ep_group, int top_k, float capacity_factor, str schedule, str overflow=\"error\", "
      "int[] chunks=[]) -> (Tensor y, Tensor l_aux, Tensor exp_in, Tensor comb, Tensor stats)");
  m.def(
      "parm_moe_backward(Tensor grad_y, Tensor grad_l_aux, Tensor x, Tensor gate, Tensor w1, "
      "Tensor w2, Tensor exp_in, Tensor comb, Tensor stats, str mp_group, str ep_group, "
      "int top_k, float capacity_factor, str schedule, int[] chunks=[]) -> "
      "(Tensor grad_x, Tensor grad_gate, Tensor grad_w1, Tensor grad_w2)");
}
