// The kernel library without PyTorch: a varlen prefill (plan_chunk, a cudaMalloc'd workspace,
// run_chunk_forward) and a decode step from a slot pool (run_recurrent), from raw device pointers,
// each checked against a double-precision recurrence on the host. Built by CMake as
// flashkda_prefill_decode; prints one line per check and exits 1 on a failure (or without a GPU).
//   cmake -B build -DCMAKE_CUDA_ARCHITECTURES=90a && cmake --build build -j && ./build/flashkda_prefill_decode
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "flashkda/api.h"
#include "flashkda/prefill/chunk_plan.h"

namespace {

using bf16 = __nv_bfloat16;
constexpr int H = 2, HV = 4, D = flashkda::chunk::kHeadDim;
constexpr float kLowerBound = -5.f;

#define CHECK_CUDA(call)                                                                   \
  do {                                                                                     \
    const cudaError_t e = (call);                                                          \
    if (e != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e));      \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

template <typename T>
T* to_device(const std::vector<T>& host) {
  T* ptr = nullptr;
  CHECK_CUDA(cudaMalloc(&ptr, host.size() * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return ptr;
}

template <typename T>
std::vector<T> to_host(const T* ptr, size_t n) {
  std::vector<T> host(n);
  CHECK_CUDA(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

// Token inputs of T tokens: bf16 q, k [T, H, D], v, g [T, HV, D], beta [T, HV] (raw: l2 norm,
// lower-bound gate and beta sigmoid in the kernel), fp32 A_log [HV] and dt_bias [HV * D].
struct Tokens {
  int T;
  std::vector<bf16> q, k, v, g, beta;
  std::vector<float> A_log, dt_bias;
};

Tokens random_tokens(int T, std::mt19937& gen) {
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> uniform;
  auto fill = [&](size_t n, float scale) {
    std::vector<bf16> x(n);
    for (auto& e : x) e = __float2bfloat16(scale * normal(gen));
    return x;
  };
  Tokens t{T, fill(size_t(T) * H * D, 1.f), fill(size_t(T) * H * D, 1.f), fill(size_t(T) * HV * D, 1.f),
           fill(size_t(T) * HV * D, 2.f), fill(size_t(T) * HV, 1.f), std::vector<float>(HV),
           std::vector<float>(HV * D)};
  for (auto& a : t.A_log) a = uniform(gen);
  for (auto& b : t.dt_bias) b = normal(gen);
  return t;
}

// One token of the recurrence on a key-first double state S [D][D] (docs/SPEC.md): returns o [D].
std::vector<double> step(std::vector<double>& S, const Tokens& x, int t, int hv) {
  const int h = hv / (HV / H);
  auto at = [](const std::vector<bf16>& a, size_t i) { return double(__bfloat162float(a[i])); };
  std::vector<double> q(D), k(D), decay(D), v(D);
  double nq = 0, nk = 0;
  for (int c = 0; c < D; ++c) {
    q[c] = at(x.q, (size_t(t) * H + h) * D + c), k[c] = at(x.k, (size_t(t) * H + h) * D + c);
    nq += q[c] * q[c], nk += k[c] * k[c];
    const double raw = at(x.g, (size_t(t) * HV + hv) * D + c) + x.dt_bias[hv * D + c];
    decay[c] = std::exp(kLowerBound / (1 + std::exp(-std::exp(double(x.A_log[hv])) * raw)));
    v[c] = at(x.v, (size_t(t) * HV + hv) * D + c);
  }
  const double beta = 1 / (1 + std::exp(-at(x.beta, size_t(t) * HV + hv)));
  for (int c = 0; c < D; ++c) q[c] *= std::pow(double(D), -0.5) / std::sqrt(nq + 1e-6), k[c] /= std::sqrt(nk + 1e-6);
  std::vector<double> o(D, 0.0), u(D);
  for (int c = 0; c < D; ++c)
    for (int j = 0; j < D; ++j) S[c * D + j] *= decay[c];
  for (int j = 0; j < D; ++j) {
    double sk = 0;
    for (int c = 0; c < D; ++c) sk += S[c * D + j] * k[c];
    u[j] = beta * (v[j] - sk);
  }
  for (int c = 0; c < D; ++c)
    for (int j = 0; j < D; ++j) S[c * D + j] += k[c] * u[j], o[j] += S[c * D + j] * q[c];
  return o;
}

double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]), den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The fields every entry reads: token pointers and strides of dense [B, T, heads, D] tensors, the
// lower-bound gate with fp32 A_log / dt_bias, l2 norm and beta sigmoid, V-first fp32 states.
void set_common(flashkda::RecurrentParams& p, const void* q, const void* k, const void* v, const void* g,
                const void* beta, void* o, const float* A_log, const float* dt_bias, int B, int T) {
  using namespace flashkda;
  p.q = q, p.k = k, p.v = v, p.g = g, p.beta = beta, p.o = o;
  p.q_batch_stride = p.k_batch_stride = int64_t(T) * H * D, p.q_token_stride = p.k_token_stride = H * D;
  p.q_head_stride = p.k_head_stride = D;
  p.v_batch_stride = p.g_batch_stride = p.o_batch_stride = int64_t(T) * HV * D;
  p.v_token_stride = p.g_token_stride = p.o_token_stride = HV * D;
  p.v_head_stride = p.g_head_stride = p.o_head_stride = D;
  p.beta_batch_stride = int64_t(T) * HV, p.beta_token_stride = HV;
  p.A_log = A_log, p.dt_bias = dt_bias;
  p.B = B, p.T = T, p.H = H, p.HV = HV, p.D = D;
  p.scale = 1.f / std::sqrt(float(D)), p.lower_bound = kLowerBound, p.beta_scale = 1.f;
  p.gate_mode = GateMode::kLowerBound, p.l2norm = true, p.beta_sigmoid = true, p.state_v_first = true;
  p.g_dtype = p.beta_dtype = DType::kBFloat16, p.A_log_dtype = p.dt_bias_dtype = DType::kFloat32;
  p.state_in_dtype = p.state_out_dtype = DType::kFloat32;
  p.cu_type = p.idx_type = p.accepted_type = IndexType::kInt32;
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, device));
  p.kernel_family = KernelFamily::kAuto;
}

// A state's element (hv, value row j, key c) of a V-first [.., HV, V, K] slot.
size_t vfirst(int hv, int j, int c) { return (size_t(hv) * D + j) * D + c; }

bool prefill(std::mt19937& gen) {
  const std::vector<int> lens = {1, 17, 0, 97, 300};
  std::vector<int> cu = {0};
  for (int n : lens) cu.push_back(cu.back() + n);
  const int T = cu.back(), N = int(lens.size());
  const Tokens x = random_tokens(T, gen);
  std::vector<float> h0(size_t(N) * HV * D * D);
  std::normal_distribution<float> normal;
  for (auto& e : h0) e = 0.1f * normal(gen);

  flashkda::ChunkParams p{};
  bf16 *q = to_device(x.q), *k = to_device(x.k), *v = to_device(x.v), *g = to_device(x.g), *beta = to_device(x.beta);
  float *A_log = to_device(x.A_log), *dt_bias = to_device(x.dt_bias), *state_in = to_device(h0), *state_out = nullptr;
  int* cu_d = to_device(cu);
  bf16* o = nullptr;
  CHECK_CUDA(cudaMalloc(&o, size_t(T) * HV * D * sizeof(bf16)));
  CHECK_CUDA(cudaMalloc(&state_out, h0.size() * sizeof(float)));
  set_common(p, q, k, v, g, beta, o, A_log, dt_bias, 1, T);
  p.cu_seqlens = cu_d, p.N = N, p.num_slots = N, p.state_in = state_in, p.state_out = state_out;

  flashkda::ChunkWorkspace ws;
  const std::string why = flashkda::plan_chunk(p, 0, -1, ws);
  if (!why.empty()) return std::fprintf(stderr, "plan_chunk: %s\n", why.c_str()), false;
  void* workspace = nullptr;
  CHECK_CUDA(cudaMalloc(&workspace, ws.total()));
  flashkda::carve_chunk_workspace(p, ws, workspace);
  CHECK_CUDA(flashkda::run_chunk_forward<bf16>(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());

  const std::vector<bf16> o_host = to_host(o, size_t(T) * HV * D);
  const std::vector<float> ht = to_host(state_out, h0.size());
  std::vector<double> got_o, want_o, got_s, want_s;
  for (int n = 0; n < N; ++n)
    for (int hv = 0; hv < HV; ++hv) {
      std::vector<double> S(D * D);
      for (int j = 0; j < D; ++j)
        for (int c = 0; c < D; ++c) S[c * D + j] = h0[size_t(n) * HV * D * D + vfirst(hv, j, c)];
      for (int t = cu[n]; t < cu[n + 1]; ++t) {
        const std::vector<double> ot = step(S, x, t, hv);
        for (int j = 0; j < D; ++j)
          want_o.push_back(ot[j]), got_o.push_back(__bfloat162float(o_host[(size_t(t) * HV + hv) * D + j]));
      }
      for (int j = 0; j < D; ++j)
        for (int c = 0; c < D; ++c)
          want_s.push_back(S[c * D + j]), got_s.push_back(ht[size_t(n) * HV * D * D + vfirst(hv, j, c)]);
    }
  const double eo = rel_err(got_o, want_o), es = rel_err(got_s, want_s);
  std::printf("prefill (varlen 1, 17, 0, 97, 300; H = %d, HV = %d, D = %d): output %.2e, final state %.2e\n", H, HV,
              D, eo, es);
  for (void* ptr : {(void*)q, (void*)k, (void*)v, (void*)g, (void*)beta, (void*)A_log, (void*)dt_bias,
                    (void*)state_in, (void*)state_out, (void*)cu_d, (void*)o, workspace})
    CHECK_CUDA(cudaFree(ptr));
  return eo <= 6e-3 && es <= 5e-3;
}

bool decode(std::mt19937& gen) {
  const int N = 5, slots = 8;
  const std::vector<int> slot_ids = {6, 0, -1, 3, 7};  // -1: a padding row
  const Tokens x = random_tokens(N, gen);             // one token per sequence: [N, 1, ...]
  std::vector<float> pool(size_t(slots) * HV * D * D);
  std::normal_distribution<float> normal;
  for (auto& e : pool) e = 0.1f * normal(gen);

  flashkda::RecurrentParams p{};
  bf16 *q = to_device(x.q), *k = to_device(x.k), *v = to_device(x.v), *g = to_device(x.g), *beta = to_device(x.beta);
  float *A_log = to_device(x.A_log), *dt_bias = to_device(x.dt_bias), *pool_d = to_device(pool);
  int* idx = to_device(slot_ids);
  bf16* o = nullptr;
  CHECK_CUDA(cudaMalloc(&o, size_t(N) * HV * D * sizeof(bf16)));
  set_common(p, q, k, v, g, beta, o, A_log, dt_bias, N, 1);
  p.N = N, p.state_in = pool_d, p.state_out = pool_d, p.slot_indices = idx, p.num_slots = slots;
  p.idx_cols = 0, p.idx_row_stride = 1;
  CHECK_CUDA((flashkda::run_recurrent<bf16, D>(p, nullptr)));
  CHECK_CUDA(cudaDeviceSynchronize());

  const std::vector<bf16> o_host = to_host(o, size_t(N) * HV * D);
  const std::vector<float> after = to_host(pool_d, pool.size());
  std::vector<double> got_o, want_o, got_s, want_s;
  std::vector<bool> named(slots, false);
  for (int n = 0; n < N; ++n)
    for (int hv = 0; hv < HV; ++hv) {
      const int slot = slot_ids[n];
      std::vector<double> ot(D, 0.0);
      if (slot >= 0) {
        named[slot] = true;
        std::vector<double> S(D * D);
        for (int j = 0; j < D; ++j)
          for (int c = 0; c < D; ++c) S[c * D + j] = pool[size_t(slot) * HV * D * D + vfirst(hv, j, c)];
        ot = step(S, x, n, hv);
        for (int j = 0; j < D; ++j)
          for (int c = 0; c < D; ++c)
            want_s.push_back(S[c * D + j]), got_s.push_back(after[size_t(slot) * HV * D * D + vfirst(hv, j, c)]);
      }
      for (int j = 0; j < D; ++j)
        want_o.push_back(ot[j]), got_o.push_back(__bfloat162float(o_host[(size_t(n) * HV + hv) * D + j]));
    }
  bool untouched = true;  // slots no index names keep their bytes
  for (int s = 0; s < slots; ++s)
    for (size_t i = 0; !named[s] && i < size_t(HV) * D * D; ++i)
      untouched = untouched && after[size_t(s) * HV * D * D + i] == pool[size_t(s) * HV * D * D + i];
  const double eo = rel_err(got_o, want_o), es = rel_err(got_s, want_s);
  std::printf("decode (N = %d from a pool of %d slots, one padding row): output %.2e, states %.2e, other slots %s\n",
              N, slots, eo, es, untouched ? "untouched" : "CHANGED");
  for (void* ptr : {(void*)q, (void*)k, (void*)v, (void*)g, (void*)beta, (void*)A_log, (void*)dt_bias,
                    (void*)pool_d, (void*)idx, (void*)o})
    CHECK_CUDA(cudaFree(ptr));
  return eo <= 6e-3 && es <= 1e-4 && untouched;
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  CHECK_CUDA(flashkda::kernel_image_status());
  std::mt19937 gen(7);
  const bool ok_prefill = prefill(gen), ok_decode = decode(gen);
  std::printf("%s\n", ok_prefill && ok_decode ? "OK" : "FAILED");
  return ok_prefill && ok_decode ? 0 : 1;
}
