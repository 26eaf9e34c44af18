// Fused CPU kernels for zeal's serving engine, built on first use by
// zeal/inference/kernels/__init__.py (torch.utils.cpp_extension, -O3 -march=native).
//
// Every kernel computes in fp32 whatever the storage dtype (fp32, bf16, fp16), on
// 16-lane GCC/Clang vector types that the compiler maps to the machine's registers
// (AVX-512, AVX2, NEON); the one ISA-specific path, bf16 prompt attention on
// AVX512-BF16, sits behind its feature macro. Threads come from ATen's own pool
// (at::parallel_for; the library links the libgomp torch already loaded), so they never
// compete with a second OpenMP runtime. The pure-torch code in inference/attention.py and
// models/ (gpt.py, llama.py, attention.py) is the reference each kernel is tested against.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

// ---------------------------------------------------------------- vectors
// GCC/Clang vector extensions: 16 fp32 lanes, one AVX-512 register (two AVX2, four NEON).
constexpr int64_t W = 16;
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu32 __attribute__((vector_size(W * 4)));
typedef uint16_t vu16 __attribute__((vector_size(W * 2)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf vbroadcast(float x) { return vf{} + x; }
inline int64_t round_up(int64_t n) { return (n + W - 1) / W * W; }

inline float hsum(vf v) {
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)  // GCC 12+, Clang
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
#else
  float s = 0.f;
  for (int64_t i = 0; i < W; ++i) s += v[i];
  return s;
#endif
}

inline float hmax(vf v) {
  float m = v[0];
  for (int64_t i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}

// e^x on [-87, 88] (clamped outside): x = n ln2 + r with ln2 split in two (the first part
// exact in fp32) and r in [-ln2/2, ln2/2]; e^r by its Taylor series to r^7 (remainder
// < r^8/8! < 6e-9), times 2^n built in the exponent bits. e^-inf gives 2^-126 * e^r,
// below every softmax sum it joins. Branch-free, so it vectorises.
inline vf vexp(vf x) {
  x = x < -87.0f ? vbroadcast(-87.0f) : x;
  x = x > 88.0f ? vbroadcast(88.0f) : x;
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23)
  const vf r = (x - n * 0.693359375f) + n * 2.12194440e-4f;               // ln2 = 0.693359375 - 2.12194440e-4
  vf p = r * (1.0f / 5040.0f) + (1.0f / 720.0f);
  p = p * r + (1.0f / 120.0f);
  p = p * r + (1.0f / 24.0f);
  p = p * r + (1.0f / 6.0f);
  p = p * r + 0.5f;
  p = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * reinterpret_cast<const vf&>(bits);
}

// ---------------------------------------------------------------- rows
// A row of n stored elements to fp32, zero-padded to np (a multiple of W).
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n, int64_t np) {
  int64_t i = 0;
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  for (; i < np; ++i) dst[i] = 0.f;
}

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n, int64_t np) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + W <= n; i += W) {  // bf16 -> fp32 is a 16-bit shift
    vu16 u;
    std::memcpy(&u, s + i, sizeof u);
    const vu32 w = __builtin_convertvector(u, vu32) << 16;
    std::memcpy(dst + i, &w, sizeof w);
  }
  for (; i < n; ++i) {
    const uint32_t w = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(dst + i, &w, sizeof w);
  }
  for (; i < np; ++i) dst[i] = 0.f;
}

inline void to_float(const float* src, float* dst, int64_t n, int64_t np) {
  std::memcpy(dst, src, n * sizeof(float));
  for (int64_t i = n; i < np; ++i) dst[i] = 0.f;
}

// fp32 -> storage dtype, rounding to nearest even (as Tensor.to does)
template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

inline void from_float(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    vu32 b;
    std::memcpy(&b, src + i, sizeof b);
    vu32 r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    r = (b & 0x7fffffffu) > 0x7f800000u ? vu32{} + 0x7fc0u : r;  // NaN stays a (quiet) NaN
    const vu16 h = __builtin_convertvector(r, vu16);
    std::memcpy(d + i, &h, sizeof h);
  }
  for (; i < n; ++i) dst[i] = static_cast<c10::BFloat16>(src[i]);
}

inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

void check(bool ok, const char* what) { TORCH_CHECK(ok, "zeal cpu kernel: ", what); }

// f(i) for i in [0, n), dealt out round-robin over the threads: items whose cost grows
// with i (causal tiles) or varies (context lengths) still split evenly
template <typename F>
void parallel_strided(int64_t n, const F& f) {
  const int64_t lanes = std::max<int64_t>(1, std::min<int64_t>(n, at::get_num_threads()));
  at::parallel_for(0, lanes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t lane = begin; lane < end; ++lane)
      for (int64_t i = lane; i < n; i += lanes) f(i);
  });
}

// One step of an online softmax over a row of scores s[0, n) (n a multiple of W) of which
// only s[0, see) are real: the row's running maximum and sum take the new scores in, and
// put(c, e) stores the 16 weights e = e^(s[c..c+16) - max), zero past `see`, returning
// them as stored (rounded, perhaps), which is what the sum adds. Returns the factor for the
// row's accumulated output (0 at the first step, whose old maximum is -inf).
template <typename Put>
inline float online_softmax(const float* s, int64_t n, int64_t see, float& mx, float& sum, const Put& put) {
  vf vm = vbroadcast(mx);
  for (int64_t c = 0; c < see; c += W) {
    vf x = vload(s + c);
    for (int64_t i = see - c; i < W; ++i) x[i] = mx;  // lanes past `see` take no part
    vm = x > vm ? x : vm;
  }
  const float m = hmax(vm), corr = std::exp(mx - m);
  vf l = {};
  for (int64_t c = 0; c < n; c += W) {
    vf e = vexp(vload(s + c) - m);
    if (c + W > see)
      for (int64_t i = std::max<int64_t>(0, see - c); i < W; ++i) e[i] = 0.f;
    l += put(c, e);
  }
  sum = sum * corr + hsum(l);
  mx = m;
  return corr;
}

// run the statement with `scalar` bound to the C++ type of a floating dtype
#define ZEAL_DISPATCH(dtype, NAME, ...)                                   \
  switch (dtype) {                                                        \
    case at::kFloat: { using scalar = float; __VA_ARGS__; break; }        \
    case at::kBFloat16: { using scalar = c10::BFloat16; __VA_ARGS__; break; } \
    case at::kHalf: { using scalar = c10::Half; __VA_ARGS__; break; }     \
    default: check(false, NAME ": dtype must be float32, bfloat16 or float16"); \
  }

// ---------------------------------------------------------------- decode attention
// One query token per sequence d over its cached context, read block by block through
// its block table: for every (sequence, K/V head) the grouped query heads share each
// K/V row (loaded once, converted once); softmax is online, rescaled once per block.

// C vectors of one stored row (C * W >= n elements, zero-padded), converted to fp32 in registers
template <int C, typename T>
inline void load_vecs(const T* src, int64_t n, float* buf, vf* out) {
  to_float(src, buf, n, C * W);
  for (int c = 0; c < C; ++c) out[c] = vload(buf + c * W);
}

template <int C>
inline void load_vecs(const c10::BFloat16* src, int64_t n, float* buf, vf* out) {
  if (n == C * W) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (int c = 0; c < C; ++c) {
      vu16 u;
      std::memcpy(&u, s + c * W, sizeof u);
      const vu32 w = __builtin_convertvector(u, vu32) << 16;
      out[c] = reinterpret_cast<const vf&>(w);
    }
    return;
  }
  to_float(src, buf, n, C * W);
  for (int c = 0; c < C; ++c) out[c] = vload(buf + c * W);
}

template <int C>
inline void load_vecs(const float* src, int64_t n, float* buf, vf* out) {
  if (n == C * W) {
    for (int c = 0; c < C; ++c) out[c] = vload(src + c * W);
    return;
  }
  to_float(src, buf, n, C * W);
  for (int c = 0; c < C; ++c) out[c] = vload(buf + c * W);
}


struct DecodeArgs {
  int64_t NH, HD, NKV, BS, MB;
  float scale;
};

// GS query heads (rows of K/V head h) of decode d: every K/V row is read and converted
// once for all of them; queries and accumulators stay in registers (GS * C <= 16).
template <typename T, int C, int GS>
void decode_heads(const DecodeArgs& a, const T* qp, const T* kp, const T* vp, const int32_t* table,
                  int64_t n, int64_t d, int64_t h, int64_t g0, float* s, float* buf, T* op) {
  const int64_t BP = round_up(a.BS);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  vf q[GS][C], acc[GS][C];
  float mx[GS], sum[GS];
  for (int g = 0; g < GS; ++g) {
    load_vecs<C>(qp + (d * a.NH + g0 + g) * a.HD, a.HD, buf, q[g]);
    for (int c = 0; c < C; ++c) {
      q[g][c] *= a.scale;
      acc[g][c] = vf{};
    }
    mx[g] = neg_inf;
    sum[g] = 0.f;
  }
  for (int64_t j = 0; j * a.BS < n; ++j) {
    const int64_t blk = table[j], cnt = std::min(a.BS, n - j * a.BS), cp = round_up(cnt);
    const T* kb = kp + (blk * a.NKV + h) * a.BS * a.HD;
    const T* vb = vp + (blk * a.NKV + h) * a.BS * a.HD;
    // the next block lies elsewhere in memory: ask for it while this one is computed
    const bool more = (j + 1) * a.BS < n;
    const int64_t next = more ? table[j + 1] : blk;
    const char* kn = reinterpret_cast<const char*>(kp + (next * a.NKV + h) * a.BS * a.HD);
    const char* vn = reinterpret_cast<const char*>(vp + (next * a.NKV + h) * a.BS * a.HD);
    const int64_t row_bytes = a.HD * static_cast<int64_t>(sizeof(T));
    for (int64_t t = 0; t < cnt; ++t) {
      if (more)
        for (int64_t off = 0; off < row_bytes; off += 64) {
          __builtin_prefetch(kn + t * row_bytes + off);
          __builtin_prefetch(vn + t * row_bytes + off);
        }
      vf k[C];
      load_vecs<C>(kb + t * a.HD, a.HD, buf, k);
      for (int g = 0; g < GS; ++g) {
        vf x = q[g][0] * k[0];
        for (int c = 1; c < C; ++c) x += q[g][c] * k[c];
        s[g * BP + t] = hsum(x);
      }
    }
    for (int g = 0; g < GS; ++g) {  // online softmax, rescaled once per block
      float* sg = s + g * BP;
      const float corr = online_softmax(sg, cp, cnt, mx[g], sum[g], [&](int64_t c, vf e) {
        vstore(sg + c, e);
        return e;
      });
      for (int c = 0; c < C; ++c) acc[g][c] *= corr;
    }
    for (int64_t t = 0; t < cnt; ++t) {
      vf v[C];
      load_vecs<C>(vb + t * a.HD, a.HD, buf, v);
      for (int g = 0; g < GS; ++g) {
        const float p = s[g * BP + t];
        for (int c = 0; c < C; ++c) acc[g][c] += p * v[c];
      }
    }
  }
  for (int g = 0; g < GS; ++g) {
    const float inv = 1.f / sum[g];
    for (int c = 0; c < C; ++c) vstore(buf + c * W, acc[g][c] * inv);
    from_float(buf, op + (d * a.NH + g0 + g) * a.HD, a.HD);
  }
}

template <typename T, int C>
void decode_all(const DecodeArgs& a, const T* qp, const T* kp, const T* vp, const int32_t* tp,
                const int32_t* lp, int64_t D, T* op) {
  constexpr int GMAX = C >= 16 ? 1 : 16 / C < 4 ? 16 / C : 4;
  const int64_t G = a.NH / a.NKV;
  parallel_strided(D * a.NKV, [&](int64_t item) {
    thread_local std::vector<float> s, buf;
    s.resize(GMAX * round_up(a.BS)), buf.resize(C * W);
    const int64_t d = item / a.NKV, h = item % a.NKV;
    for (int64_t g0 = 0; g0 < G; g0 += GMAX) {  // the group's query heads, GMAX at a time
      const int64_t gs = std::min<int64_t>(GMAX, G - g0);
      auto run = [&](auto gs_const) {
        decode_heads<T, C, decltype(gs_const)::value>(a, qp, kp, vp, tp + d * a.MB, lp[d], d, h, h * G + g0,
                                                        s.data(), buf.data(), op);
      };
      switch (gs) {
        case 1: run(std::integral_constant<int, 1>{}); break;
        case 2: if constexpr (GMAX >= 2) run(std::integral_constant<int, 2>{}); break;
        case 3: if constexpr (GMAX >= 3) run(std::integral_constant<int, 3>{}); break;
        default: if constexpr (GMAX >= 4) run(std::integral_constant<int, 4>{}); break;
      }
    }
  });
}

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale,
                           at::Tensor& out) {
  const DecodeArgs a{q.size(1), q.size(2), k_cache.size(1), k_cache.size(2), block_tables.size(1),
                     static_cast<float>(scale)};
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const int32_t* lp = ctx_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t D = q.size(0), chunks = round_up(a.HD) / W;
  if (chunks <= 1) return decode_all<T, 1>(a, qp, kp, vp, tp, lp, D, op);
  if (chunks <= 2) return decode_all<T, 2>(a, qp, kp, vp, tp, lp, D, op);
  if (chunks <= 4) return decode_all<T, 4>(a, qp, kp, vp, tp, lp, D, op);
  if (chunks <= 8) return decode_all<T, 8>(a, qp, kp, vp, tp, lp, D, op);
  return decode_all<T, 16>(a, qp, kp, vp, tp, lp, D, op);
}

void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale, at::Tensor out) {
  check(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "decode_attention shapes");
  check(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
        "decode_attention needs contiguous tensors");
  check(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
            out.scalar_type() == q.scalar_type(),
        "decode_attention: q, caches and out must share a dtype");
  check(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(1) == 0 && q.size(2) <= 16 * W,
        "decode_attention head shapes (head_dim <= 256)");
  check(block_tables.scalar_type() == at::kInt && ctx_lens.scalar_type() == at::kInt &&
            block_tables.is_contiguous() && ctx_lens.is_contiguous(),
        "decode_attention: block_tables and ctx_lens are contiguous int32");
  check(block_tables.size(0) == q.size(0) && ctx_lens.size(0) == q.size(0) && out.sizes() == q.sizes(),
        "decode_attention: one block table and length per query");
  const int64_t BS = k_cache.size(2), MB = block_tables.size(1);
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const int32_t* lp = ctx_lens.data_ptr<int32_t>();
  for (int64_t d = 0; d < q.size(0); ++d) {
    check(lp[d] >= 1 && lp[d] <= MB * BS, "decode_attention: a context length outside [1, blocks in its table]");
    for (int64_t j = 0; j * BS < lp[d]; ++j)
      check(tp[d * MB + j] >= 0 && tp[d * MB + j] < k_cache.size(0), "decode_attention: block id out of range");
  }
  switch (q.scalar_type()) {
    case at::kFloat: return decode_attention_impl<float>(q, k_cache, v_cache, block_tables, ctx_lens, scale, out);
    case at::kBFloat16:
      return decode_attention_impl<c10::BFloat16>(q, k_cache, v_cache, block_tables, ctx_lens, scale, out);
    case at::kHalf: return decode_attention_impl<c10::Half>(q, k_cache, v_cache, block_tables, ctx_lens, scale, out);
    default: check(false, "decode_attention: dtype must be float32, bfloat16 or float16");
  }
}

// ---------------------------------------------------------------- prompt-chunk attention
// The last L of a sequence's C cached positions attend causally over its blocks (query i
// sits at position C - L + i). Per K/V head, the keys and values are first laid out in
// fp32 tiles of KT positions, keys transposed (head_dim x KT), so that every query row
// computes KT scores with plain FMAs; then tiles of R queries (times the G query heads of
// the K/V head: M = R * G rows) run an online softmax over the key tiles they can see.
constexpr int64_t KT = 64, KTV = KT / W, QR = 16;

struct ChunkArgs {
  int64_t L, C, NH, HD, NKV, BS, qs0, os0;
  float scale;
};

// scores S[m][0, KT) of RB rows against one transposed key tile
template <int RB>
inline void tile_scores(const float* qf, int64_t HP, int64_t HD, const float* kt, float* S) {
  vf acc[RB][KTV];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KTV; ++c) acc[r][c] = vf{};
  for (int64_t d = 0; d < HD; ++d) {
    vf kv[KTV];
    for (int c = 0; c < KTV; ++c) kv[c] = vload(kt + d * KT + c * W);
    for (int r = 0; r < RB; ++r) {
      const vf b = vbroadcast(qf[r * HP + d]);
      for (int c = 0; c < KTV; ++c) acc[r][c] += b * kv[c];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KTV; ++c) vstore(S + r * KT + c * W, acc[r][c]);
}

// o[m] = o[m] * corr[m] + sum_t P[m][t] V[t] for RB rows over the first n keys of a value tile
template <int C, int RB>
inline void tile_values(const float* P, const float* corr, const float* vt, int64_t n, float* o) {
  vf acc[RB][C];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vload(o + r * C * W + c * W) * corr[r];
  for (int64_t t = 0; t < n; ++t) {
    vf v[C];
    for (int c = 0; c < C; ++c) v[c] = vload(vt + t * C * W + c * W);
    for (int r = 0; r < RB; ++r) {
      const vf p = vbroadcast(P[r * KT + t]);
      for (int c = 0; c < C; ++c) acc[r][c] += p * v[c];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < C; ++c) vstore(o + r * C * W + c * W, acc[r][c]);
}

template <typename T, int C>
void chunk_attention_impl(const ChunkArgs& a, const T* qp, const T* kp, const T* vp, const int32_t* table, T* op) {
  constexpr int64_t HP = C * W;
  constexpr int RBV = C <= 4 ? 4 : (C == 8 ? 2 : 1);  // rows per value pass: RBV * C accumulators
  const int64_t G = a.NH / a.NKV, M = QR * G, ntiles = (a.C + KT - 1) / KT, nq = (a.L + QR - 1) / QR;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> kt(ntiles * HP * KT), vt(ntiles * KT * HP);
  for (int64_t h = 0; h < a.NKV; ++h) {
    at::parallel_for(0, ntiles, 1, [&](int64_t begin, int64_t end) {  // fp32 tiles of this head
      std::vector<float> row(HP);
      for (int64_t j = begin; j < end; ++j) {
        float* ktj = kt.data() + j * HP * KT;
        float* vtj = vt.data() + j * KT * HP;
        std::fill(ktj, ktj + HP * KT, 0.f);
        std::fill(vtj, vtj + KT * HP, 0.f);
        for (int64_t t = 0; t < KT && j * KT + t < a.C; ++t) {
          const int64_t pos = j * KT + t;
          const int64_t off = ((static_cast<int64_t>(table[pos / a.BS]) * a.NKV + h) * a.BS + pos % a.BS) * a.HD;
          to_float(kp + off, row.data(), a.HD, HP);
          for (int64_t d = 0; d < a.HD; ++d) ktj[d * KT + t] = row[d];
          to_float(vp + off, vtj + t * HP, a.HD, HP);
        }
      }
    });
    parallel_strided(nq, [&](int64_t qi) {
      thread_local std::vector<float> qf, o, S, mx, sum, corr;
      qf.resize(M * HP), o.resize(M * HP), S.resize(M * KT), mx.resize(M), sum.resize(M), corr.resize(M);
      const int64_t i0 = qi * QR, rows = std::min(QR, a.L - i0) * G;  // row m: query i0 + m / G, head m % G
      for (int64_t m = 0; m < rows; ++m) {
        float* qm = qf.data() + m * HP;
        to_float(qp + (i0 + m / G) * a.qs0 + (h * G + m % G) * a.HD, qm, a.HD, HP);
        for (int64_t c = 0; c < HP; c += W) vstore(qm + c, vload(qm + c) * a.scale);
      }
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(mx.begin(), mx.end(), neg_inf);
      std::fill(sum.begin(), sum.end(), 0.f);
      const int64_t first = a.C - a.L + i0, last = first + rows / G - 1;  // positions of the tile's queries
      for (int64_t j = 0; j * KT <= last; ++j) {
        const int64_t k0 = j * KT;
        const float* ktj = kt.data() + j * HP * KT;
        int64_t m = 0;
        for (; m + 4 <= rows; m += 4) tile_scores<4>(qf.data() + m * HP, HP, a.HD, ktj, S.data() + m * KT);
        for (; m < rows; ++m) tile_scores<1>(qf.data() + m * HP, HP, a.HD, ktj, S.data() + m * KT);
        int64_t nkeys = 0;  // keys of this tile that some row sees
        for (m = 0; m < rows; ++m) {
          float* sm = S.data() + m * KT;
          const int64_t see = std::min(KT, first + m / G - k0 + 1);  // keys k0 .. pos visible
          nkeys = std::max(nkeys, see);
          if (see <= 0) {  // the whole tile lies ahead of this query
            std::fill(sm, sm + KT, 0.f);
            corr[m] = 1.f;
            continue;
          }
          corr[m] = online_softmax(sm, KT, see, mx[m], sum[m], [&](int64_t c, vf e) {
            vstore(sm + c, e);
            return e;
          });
        }
        const float* vtj = vt.data() + j * KT * HP;
        for (m = 0; m + RBV <= rows; m += RBV)
          tile_values<C, RBV>(S.data() + m * KT, corr.data() + m, vtj, nkeys, o.data() + m * HP);
        for (; m < rows; ++m) tile_values<C, 1>(S.data() + m * KT, corr.data() + m, vtj, nkeys, o.data() + m * HP);
      }
      for (int64_t m = 0; m < rows; ++m) {
        float* om = o.data() + m * HP;
        const float inv = 1.f / sum[m];
        for (int64_t c = 0; c < HP; c += W) vstore(om + c, vload(om + c) * inv);
        from_float(om, op + (i0 + m / G) * a.os0 + (h * G + m % G) * a.HD, a.HD);
      }
    });
  }
}

#if defined(__AVX512BF16__)
// bf16 scores with AVX512-BF16 dot products (vdpbf16ps: 16 fp32 lanes, each += a pair of
// bf16 products, exact in fp32), twice the fp32 FMA rate; keys are laid out as (dimension
// pair, key) words. The probabilities stay fp32 for the value product (values in fp32
// tiles, as in chunk_attention_impl): rounding them to bf16 first costs greedy answers
// (SmolLM2's "capital of France" turned on it), which the torch bf16 path keeps.
template <int RB>
inline void tile_scores_bf16(const uint32_t* q, int64_t qstride, int64_t npairs, const uint32_t* kp, float scale,
                             float* S) {
  __m512 acc[RB][KTV];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KTV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < npairs; ++p) {
    __m512bh kv[KTV];
    for (int c = 0; c < KTV; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kp + p * KT + c * W);
    for (int r = 0; r < RB; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * qstride + p]));
      for (int c = 0; c < KTV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], b, kv[c]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KTV; ++c) _mm512_storeu_ps(S + r * KT + c * W, _mm512_mul_ps(acc[r][c], sc));
}

template <int C>
void chunk_attention_bf16(const ChunkArgs& a, const c10::BFloat16* qp, const c10::BFloat16* kp,
                          const c10::BFloat16* vp, const int32_t* table, c10::BFloat16* op) {
  constexpr int64_t HP = C * W;
  constexpr int RBV = C <= 4 ? 4 : (C == 8 ? 2 : 1);
  const int64_t G = a.NH / a.NKV, M = QR * G, ntiles = (a.C + KT - 1) / KT, nq = (a.L + QR - 1) / QR;
  const int64_t NP = a.HD / 2;  // dimension pairs
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const uint16_t* k16 = reinterpret_cast<const uint16_t*>(kp);
  const uint16_t* q16 = reinterpret_cast<const uint16_t*>(qp);
  std::vector<uint32_t> kt(ntiles * NP * KT);
  std::vector<float> vt(ntiles * KT * HP);
  for (int64_t h = 0; h < a.NKV; ++h) {
    at::parallel_for(0, ntiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        uint32_t* ktj = kt.data() + j * NP * KT;
        float* vtj = vt.data() + j * KT * HP;
        std::fill(ktj, ktj + NP * KT, 0u);
        std::fill(vtj, vtj + KT * HP, 0.f);
        for (int64_t t = 0; t < KT && j * KT + t < a.C; ++t) {
          const int64_t pos = j * KT + t;
          const int64_t off = ((static_cast<int64_t>(table[pos / a.BS]) * a.NKV + h) * a.BS + pos % a.BS) * a.HD;
          for (int64_t p = 0; p < NP; ++p) {
            uint32_t w;
            std::memcpy(&w, k16 + off + 2 * p, sizeof w);
            ktj[p * KT + t] = w;
          }
          to_float(vp + off, vtj + t * HP, a.HD, HP);
        }
      }
    });
    parallel_strided(nq, [&](int64_t qi) {
      thread_local std::vector<uint32_t> qw;
      thread_local std::vector<float> o, S, mx, sum, corr;
      qw.resize(M * NP), o.resize(M * HP), S.resize(M * KT), mx.resize(M), sum.resize(M), corr.resize(M);
      const int64_t i0 = qi * QR, rows = std::min(QR, a.L - i0) * G;
      for (int64_t m = 0; m < rows; ++m)
        std::memcpy(qw.data() + m * NP, q16 + (i0 + m / G) * a.qs0 + (h * G + m % G) * a.HD, NP * sizeof(uint32_t));
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(mx.begin(), mx.end(), neg_inf);
      std::fill(sum.begin(), sum.end(), 0.f);
      const int64_t first = a.C - a.L + i0, last = first + rows / G - 1;
      for (int64_t j = 0; j * KT <= last; ++j) {
        const int64_t k0 = j * KT;
        const uint32_t* ktj = kt.data() + j * NP * KT;
        int64_t m = 0;
        for (; m + 4 <= rows; m += 4)
          tile_scores_bf16<4>(qw.data() + m * NP, NP, NP, ktj, a.scale, S.data() + m * KT);
        for (; m < rows; ++m) tile_scores_bf16<1>(qw.data() + m * NP, NP, NP, ktj, a.scale, S.data() + m * KT);
        int64_t nkeys = 0;
        for (m = 0; m < rows; ++m) {
          float* sm = S.data() + m * KT;
          const int64_t see = std::min(KT, first + m / G - k0 + 1);
          nkeys = std::max(nkeys, see);
          if (see <= 0) {
            std::fill(sm, sm + KT, 0.f);
            corr[m] = 1.f;
            continue;
          }
          corr[m] = online_softmax(sm, KT, see, mx[m], sum[m], [&](int64_t c, vf e) {
            vstore(sm + c, e);  // fp32 probabilities into the value product
            return e;
          });
        }
        const float* vtj = vt.data() + j * KT * HP;
        for (m = 0; m + RBV <= rows; m += RBV)
          tile_values<C, RBV>(S.data() + m * KT, corr.data() + m, vtj, nkeys, o.data() + m * HP);
        for (; m < rows; ++m) tile_values<C, 1>(S.data() + m * KT, corr.data() + m, vtj, nkeys, o.data() + m * HP);
      }
      for (int64_t m = 0; m < rows; ++m) {
        float* om = o.data() + m * HP;
        const float inv = 1.f / sum[m];
        for (int64_t c = 0; c < HP; c += W) vstore(om + c, vload(om + c) * inv);
        from_float(om, op + (i0 + m / G) * a.os0 + (h * G + m % G) * a.HD, a.HD);
      }
    });
  }
}
#endif

template <typename T>
void chunk_attention_any(const ChunkArgs& a, const T* qp, const T* kp, const T* vp, const int32_t* tp, T* op) {
  const int64_t chunks = round_up(a.HD) / W;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (a.HD % 2 == 0) {
      if (chunks <= 1) return chunk_attention_bf16<1>(a, qp, kp, vp, tp, op);
      if (chunks <= 2) return chunk_attention_bf16<2>(a, qp, kp, vp, tp, op);
      if (chunks <= 4) return chunk_attention_bf16<4>(a, qp, kp, vp, tp, op);
      if (chunks <= 8) return chunk_attention_bf16<8>(a, qp, kp, vp, tp, op);
      return chunk_attention_bf16<16>(a, qp, kp, vp, tp, op);
    }
  }
#endif
  if (chunks <= 1) return chunk_attention_impl<T, 1>(a, qp, kp, vp, tp, op);
  if (chunks <= 2) return chunk_attention_impl<T, 2>(a, qp, kp, vp, tp, op);
  if (chunks <= 4) return chunk_attention_impl<T, 4>(a, qp, kp, vp, tp, op);
  if (chunks <= 8) return chunk_attention_impl<T, 8>(a, qp, kp, vp, tp, op);
  return chunk_attention_impl<T, 16>(a, qp, kp, vp, tp, op);
}

// Causal attention of a prompt chunk q (L, nh, hd), the last L of ctx_len cached positions,
// over the sequence's blocks; writes out (L, nh, hd).
void chunk_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_table, int64_t ctx_len, double scale, at::Tensor out) {
  check(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && out.sizes() == q.sizes(),
        "chunk_attention shapes");
  check(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 && out.stride(1) == out.size(2),
        "chunk_attention: the heads of a token must be contiguous");
  check(k_cache.is_contiguous() && v_cache.is_contiguous(), "chunk_attention: contiguous caches");
  check(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
            out.scalar_type() == q.scalar_type(),
        "chunk_attention: q, caches and out must share a dtype");
  check(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(1) == 0 && q.size(2) <= 16 * W,
        "chunk_attention head shapes (head_dim <= 256)");
  const int64_t BS = k_cache.size(2);
  check(block_table.scalar_type() == at::kInt && block_table.is_contiguous() && q.size(0) <= ctx_len &&
            block_table.numel() * BS >= ctx_len,
        "chunk_attention: an int32 block table covering ctx_len >= the chunk's length");
  const int32_t* tp = block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < (ctx_len + BS - 1) / BS; ++b)
    check(tp[b] >= 0 && tp[b] < k_cache.size(0), "chunk_attention: block id out of range");
  const ChunkArgs a{q.size(0), ctx_len, q.size(1), q.size(2), k_cache.size(1), BS, q.stride(0), out.stride(0),
                    static_cast<float>(scale)};
  ZEAL_DISPATCH(q.scalar_type(), "chunk_attention",
                chunk_attention_any<scalar>(a, q.data_ptr<scalar>(), k_cache.data_ptr<scalar>(),
                                            v_cache.data_ptr<scalar>(), tp, out.data_ptr<scalar>()));
}

// ---------------------------------------------------------------- cache writes
// k, v (T, n_kv, hd) into their slots of (blocks, n_kv, block_size, hd) caches.
void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots) {
  check(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k.dim() == 3 && v.sizes() == k.sizes(),
        "write_kv shapes");
  check(k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(3) && slots.size(0) == k.size(0),
        "write_kv: one slot per token, heads and head_dim of the cache");
  check(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.scalar_type() == at::kLong &&
            slots.is_contiguous() && k.scalar_type() == k_cache.scalar_type() &&
            v.scalar_type() == k_cache.scalar_type(),
        "write_kv: contiguous caches, int64 slots, k/v in the cache dtype");
  check(k.stride(2) == 1 && v.stride(2) == 1, "write_kv: k/v rows must be contiguous");
  const int64_t T = k.size(0), NKV = k.size(1), HD = k.size(2), BS = k_cache.size(2);
  const int64_t nslots = k_cache.size(0) * BS, esz = k.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) check(sp[t] >= 0 && sp[t] < nslots, "write_kv: slot out of range");
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t blk = sp[t] / BS, off = sp[t] % BS;
    for (int64_t h = 0; h < NKV; ++h) {
      const int64_t dst = ((blk * NKV + h) * BS + off) * HD * esz;
      std::memcpy(kc + dst, kp + (t * k.stride(0) + h * k.stride(1)) * esz, HD * esz);
      std::memcpy(vc + dst, vp + (t * v.stride(0) + h * v.stride(1)) * esz, HD * esz);
    }
  }
}

// ---------------------------------------------------------------- elementwise
// Rows are processed in fp32 and rounded once to the storage dtype. Work is split over
// threads only when it is large enough to pay for waking them.
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

// Normalise rows of x over the last dimension: LayerNorm (centred, then * weight + bias)
// or RMSNorm (not centred, * weight). With delta, x += delta first, in place and rounded to
// x's dtype as a separate residual add would be. x (the residual stream) is either in the
// dtype T of the rest or in fp32 (TX = float: a 16-bit model's stream kept unrounded).
template <typename TX, typename T>
void norm_impl(TX* x, const T* delta, const T* w, const T* b, bool center, int64_t rows, int64_t H, float eps,
               T* out) {
  const int64_t HP = round_up(H);
  at::parallel_for(0, rows, row_grain(H), [&](int64_t begin, int64_t end) {
    std::vector<float> a(HP), d(HP), wf(HP), bf(HP, 0.f);
    to_float(w, wf.data(), H, HP);
    if (b != nullptr) to_float(b, bf.data(), H, HP);
    for (int64_t r = begin; r < end; ++r) {
      TX* xr = x + r * H;
      to_float(xr, a.data(), H, HP);
      if (delta != nullptr) {
        to_float(delta + r * H, d.data(), H, HP);
        for (int64_t c = 0; c < HP; c += W) vstore(a.data() + c, vload(a.data() + c) + vload(d.data() + c));
        from_float(a.data(), xr, H);
        to_float(xr, a.data(), H, HP);
      }
      float mean = 0.f;
      if (center) {
        vf sm = {};
        for (int64_t c = 0; c < HP; c += W) sm += vload(a.data() + c);
        mean = hsum(sm) / static_cast<float>(H);
      }
      vf ss = {};
      for (int64_t c = 0; c < H; c += W) {  // padded lanes hold 0, not the mean: skip them
        vf e = vload(a.data() + c) - mean;
        for (int64_t i = H - c; i < W; ++i) e[i] = 0.f;
        ss += e * e;
      }
      const float inv = 1.f / std::sqrt(hsum(ss) / static_cast<float>(H) + eps);
      for (int64_t c = 0; c < HP; c += W)
        vstore(a.data() + c, (vload(a.data() + c) - mean) * inv * vload(wf.data() + c) + vload(bf.data() + c));
      from_float(a.data(), out + r * H, H);
    }
  });
}

void norm(const char* name, at::Tensor& x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
          const at::Tensor* bias, double eps, at::Tensor& out) {
  const int64_t H = x.size(-1), rows = x.numel() / std::max<int64_t>(1, H);
  const at::ScalarType dt = weight.scalar_type();  // of out, delta and bias; x's too, or fp32
  const auto like_weight = [&](const at::Tensor& t) {
    return t.is_contiguous() && t.numel() == H && t.scalar_type() == dt;
  };
  const bool wide = x.scalar_type() == at::kFloat && dt != at::kFloat;
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == dt &&
                  (x.scalar_type() == dt || wide) && like_weight(weight) && (bias == nullptr || like_weight(*bias)),
              "zeal cpu kernel: ", name, ": contiguous x, out, weight (and bias) of one dtype (x may be float32)");
  TORCH_CHECK(!delta.has_value() || (delta->is_contiguous() && delta->sizes() == x.sizes() &&
                                     delta->scalar_type() == dt),
              "zeal cpu kernel: ", name, ": delta of x's shape, in the weight's dtype");
  const float e = static_cast<float>(eps);
  if (wide) {
    ZEAL_DISPATCH(dt, "norm",
                  norm_impl<float, scalar>(x.data_ptr<float>(), delta.has_value() ? delta->data_ptr<scalar>() : nullptr,
                                           weight.data_ptr<scalar>(), bias != nullptr ? bias->data_ptr<scalar>() : nullptr,
                                           bias != nullptr, rows, H, e, out.data_ptr<scalar>()));
    return;
  }
  ZEAL_DISPATCH(dt, "norm",
                norm_impl<scalar, scalar>(x.data_ptr<scalar>(), delta.has_value() ? delta->data_ptr<scalar>() : nullptr,
                                          weight.data_ptr<scalar>(), bias != nullptr ? bias->data_ptr<scalar>() : nullptr,
                                          bias != nullptr, rows, H, e, out.data_ptr<scalar>()));
}

// out = x / rms(x) * weight; with delta, first x += delta (in place)
void rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps,
              at::Tensor out) {
  norm("rms_norm", x, delta, weight, nullptr, eps, out);
}

// out = (x - mean) / std * weight + bias; with delta, first x += delta (in place)
void layer_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                const at::Tensor& bias, double eps, at::Tensor out) {
  norm("layer_norm", x, delta, weight, &bias, eps, out);
}

// x = gelu(x) with the tanh approximation (GPT-2's "gelu_new"), in place
template <typename T>
void gelu_tanh_impl(T* x, int64_t rows, int64_t I) {
  const int64_t HP = round_up(I);
  at::parallel_for(0, rows, row_grain(I), [&](int64_t begin, int64_t end) {
    std::vector<float> a(HP);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * I, a.data(), I, HP);
      for (int64_t i = 0; i < HP; i += W) {
        const vf v = vload(a.data() + i);
        const vf u = (v + v * v * v * 0.044715f) * 0.7978845608028654f;
        const vf th = 1.f - 2.f / (vexp(2.f * u) + 1.f);
        vstore(a.data() + i, 0.5f * v * (1.f + th));
      }
      from_float(a.data(), x + r * I, I);
    }
  });
}

void gelu_tanh(at::Tensor x) {
  check(x.is_contiguous(), "gelu_tanh: a contiguous tensor");
  const int64_t I = x.size(-1), rows = x.numel() / std::max<int64_t>(1, I);
  ZEAL_DISPATCH(x.scalar_type(), "gelu_tanh", gelu_tanh_impl<scalar>(x.data_ptr<scalar>(), rows, I));
}

// Rotary embedding in place, "rotate half" layout: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) per
// head, with cos/sin (T, hd/2) in fp32. x: (T, heads, hd) with contiguous heads.
template <typename T>
void rope_impl(T* x, int64_t s0, int64_t T_, int64_t heads, int64_t hd, const float* cs, const float* sn) {
  const int64_t half = hd / 2, HP = round_up(half);
  at::parallel_for(0, T_, row_grain(heads * hd), [&](int64_t begin, int64_t end) {
    std::vector<float> a(HP), b(HP), c(HP), s(HP);
    for (int64_t t = begin; t < end; ++t) {
      to_float(cs + t * half, c.data(), half, HP);
      to_float(sn + t * half, s.data(), half, HP);
      for (int64_t h = 0; h < heads; ++h) {
        T* xr = x + t * s0 + h * hd;
        to_float(xr, a.data(), half, HP);
        to_float(xr + half, b.data(), half, HP);
        for (int64_t i = 0; i < HP; i += W) {
          const vf x1 = vload(a.data() + i), x2 = vload(b.data() + i);
          const vf cv = vload(c.data() + i), sv = vload(s.data() + i);
          vstore(a.data() + i, x1 * cv - x2 * sv);
          vstore(b.data() + i, x2 * cv + x1 * sv);
        }
        from_float(a.data(), xr, half);
        from_float(b.data(), xr + half, half);
      }
    }
  });
}

void rope(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  check(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
        "rope: q (T, heads, hd), k (T, kv heads, hd), hd even");
  check(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2),
        "rope: the heads of a token must be contiguous");
  check(q.scalar_type() == k.scalar_type(), "rope: q and k share a dtype");
  check(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
            sin.is_contiguous() && cos.numel() == q.size(0) * q.size(2) / 2 && sin.sizes() == cos.sizes(),
        "rope: cos and sin are contiguous float32 (T, hd/2)");
  ZEAL_DISPATCH(q.scalar_type(), "rope",
                rope_impl<scalar>(q.data_ptr<scalar>(), q.stride(0), q.size(0), q.size(1), q.size(2),
                                  cos.data_ptr<float>(), sin.data_ptr<float>());
                rope_impl<scalar>(k.data_ptr<scalar>(), k.stride(0), k.size(0), k.size(1), k.size(2),
                                  cos.data_ptr<float>(), sin.data_ptr<float>()));
}

// gate = silu(gate) * up, in place
template <typename T>
void silu_mul_impl(T* g, const T* u, int64_t rows, int64_t I) {
  const int64_t HP = round_up(I);
  at::parallel_for(0, rows, row_grain(I), [&](int64_t begin, int64_t end) {
    std::vector<float> a(HP), b(HP);
    for (int64_t r = begin; r < end; ++r) {
      to_float(g + r * I, a.data(), I, HP);
      to_float(u + r * I, b.data(), I, HP);
      for (int64_t i = 0; i < HP; i += W) {
        const vf x = vload(a.data() + i);
        vstore(a.data() + i, x / (1.f + vexp(-x)) * vload(b.data() + i));
      }
      from_float(a.data(), g + r * I, I);
    }
  });
}

void silu_mul(at::Tensor gate, const at::Tensor& up) {
  check(gate.is_contiguous() && up.is_contiguous() && gate.sizes() == up.sizes() &&
            gate.scalar_type() == up.scalar_type(),
        "silu_mul: contiguous gate and up of one shape and dtype");
  const int64_t I = gate.size(-1), rows = gate.numel() / std::max<int64_t>(1, I);
  ZEAL_DISPATCH(gate.scalar_type(), "silu_mul", silu_mul_impl<scalar>(gate.data_ptr<scalar>(), up.data_ptr<scalar>(), rows, I));
}

// ---------------------------------------------------------------- greedy sampling
// Index of the first maximum of every row (torch.argmax's tie rule); a row whose every
// entry is NaN gives 0.
template <typename T>
void argmax_impl(const T* x, int64_t rows, int64_t V, int64_t* out) {
  const int64_t chunk = 1024;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(chunk);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * V;
      float best = -std::numeric_limits<float>::infinity();
      int64_t arg = 0;
      bool found = false;
      for (int64_t c0 = 0; c0 < V; c0 += chunk) {
        const int64_t n = std::min(chunk, V - c0), np = round_up(n);
        to_float(xr + c0, buf.data(), n, np);
        for (int64_t i = n; i < np; ++i) buf[i] = -std::numeric_limits<float>::infinity();
        vf vm = vbroadcast(best);
        for (int64_t i = 0; i < np; i += W) {
          const vf v = vload(buf.data() + i);
          vm = v > vm ? v : vm;
        }
        const float m = hmax(vm);
        if (m > best || !found) {
          for (int64_t i = 0; i < n; ++i)
            if (buf[i] == m && (m > best || !found)) {
              best = m;
              arg = c0 + i;
              found = true;
              break;
            }
        }
      }
      out[r] = arg;
    }
  });
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check(x.dim() == 2 && x.is_contiguous(), "argmax_rows: a contiguous (rows, V) tensor");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  ZEAL_DISPATCH(x.scalar_type(), "argmax_rows",
                argmax_impl<scalar>(x.data_ptr<scalar>(), x.size(0), x.size(1), out.data_ptr<int64_t>()));
  return out;
}

}  // namespace

TORCH_LIBRARY(zeal_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor ctx_lens, "
        "float scale, Tensor(a!) out) -> ()",
        &decode_attention);
  m.def("rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps, Tensor(b!) out) -> ()", &rms_norm);
  m.def("layer_norm(Tensor(a!) x, Tensor? delta, Tensor weight, Tensor bias, float eps, Tensor(b!) out) -> ()",
        &layer_norm);
  m.def("gelu_tanh(Tensor(a!) x) -> ()", &gelu_tanh);
  m.def("rope(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()", &rope);
  m.def("silu_mul(Tensor(a!) gate, Tensor up) -> ()", &silu_mul);
  m.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows);
  m.def("chunk_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int ctx_len, float scale, "
        "Tensor(a!) out) -> ()",
        &chunk_attention);
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) -> ()", &write_kv);
}
