// The device arrays of one grouped product for the variants (variant.cuh): group e is rows
// [offs[e - 1], offs[e]) of x times w[e], into the same rows of d.
#include <cstdlib>
#include <vector>

#include "variant.cuh"

namespace {

// swap: the arrays of d^T = w^T x^T (variant.cuh's Swap variants) instead of d = x w.
gv::Problems* prepare(int groups, const int* offs, const void* x, const void* w, void* d, int k,
                      int n, bool swap) {
  using namespace gv;
  std::vector<Shape> shapes(groups);
  std::vector<const Bf16*> a(groups), b(groups);
  std::vector<Bf16*> out(groups);
  std::vector<int64_t> sa(groups), sb(groups), sd(groups);  // each stride's one dynamic extent
  for (int e = 0; e < groups; ++e) {
    const int begin = e == 0 ? 0 : offs[e - 1], rows = offs[e] - begin;
    const Bf16* xe = static_cast<const Bf16*>(x) + int64_t(begin) * k;
    const Bf16* we = static_cast<const Bf16*>(w) + int64_t(e) * k * n;
    shapes[e] = swap ? Shape{n, rows, k} : Shape{rows, n, k};
    a[e] = swap ? we : xe;
    b[e] = swap ? xe : we;
    out[e] = static_cast<Bf16*>(d) + int64_t(begin) * n;
    sa[e] = swap ? n : k;
    sb[e] = swap ? k : n;
    sd[e] = n;
  }
  auto* p = new Problems;
  p->groups = groups;
  bool ok = true;
  auto put = [&](auto** dst, const auto& src) {
    using T = typename std::decay_t<decltype(src)>::value_type;
    ok = ok && cudaMalloc(reinterpret_cast<void**>(dst), sizeof(T) * groups) == cudaSuccess &&
         cudaMemcpy(*dst, src.data(), sizeof(T) * groups, cudaMemcpyHostToDevice) == cudaSuccess;
  };
  put(&p->shapes, shapes);
  put(&p->a, a);
  put(&p->b, b);
  put(&p->d, out);
  put(reinterpret_cast<int64_t**>(&p->sa), sa);
  put(reinterpret_cast<int64_t**>(&p->sb), sb);
  put(reinterpret_cast<int64_t**>(&p->sd), sd);
  if (!ok) return nullptr;
  return p;
}

}  // namespace

// offs: the E cumulative row ends, on the host. Returns null on a CUDA error.
extern "C" gv::Problems* gv_prepare(int groups, const int* offs, const void* x, const void* w,
                                    void* d, int k, int n) {
  return prepare(groups, offs, x, w, d, k, n, false);
}

// The same product for the Swap variants (d^T = w^T x^T, d stored as by gv_prepare).
extern "C" gv::Problems* gv_prepare_swapped(int groups, const int* offs, const void* x,
                                            const void* w, void* d, int k, int n) {
  return prepare(groups, offs, x, w, d, k, n, true);
}

extern "C" void gv_free(gv::Problems* p) {
  if (p == nullptr) return;
  cudaFree(p->shapes);
  cudaFree(p->a);
  cudaFree(p->b);
  cudaFree(p->d);
  cudaFree(p->sa);
  cudaFree(p->sb);
  cudaFree(p->sd);
  delete p;
}
