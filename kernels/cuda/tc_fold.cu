// attend_tc's one-launch path (issue 18): the dense tail's blocks and the
// reduce folded into the attend launch. Bound by veloxquant/kernels/tc.py
// after tc_attention.cu's header; called from its attend_tc section.
//
// A decode call used to be two launches: attend (one partial per block) and
// reduce / reduce_tail (merge, plus the 16-bit tail tiers). Launches cost the
// host microseconds each (docs/kernels.md), so here the dense tail
// is attended by extra blocks of the same grid, each writing a partial like a
// code block, and the last block of a kv head to finish merges that head's
// partials: a per-head counter, bumped after a block's partial is written and
// fenced (the CUDA threadFenceReduction pattern). The last block puts the
// counter back to 0, so the next launch finds it zeroed; tc.py orders every
// launch that shares a counter (no two run at once).

//@@ tc_tail_header
// The partial of TT dense tokens [t0, t0 + TT) of the tail (tiers 0 and 1, read
// in place through their token / channel strides) for the ROWS rows of one kv
// head, in log2 units like a code block's. Shared memory: q rows, the keys (then
// the values) with one float of padding per row (no bank conflicts when lanes
// walk tokens), probabilities.
template <int D, int ROWS, int LQ, int NW, int TT, class T, class TX>
__device__ __forceinline__ void vq_tail_partial(
    float* sm, const T* qh, long long qh1, long long qh2, long long qh3,
    const TX* k0, const TX* v0, long long k0t, long long k0d, long long v0t, long long v0d, int W0,
    const TX* k1, const TX* v1, long long k1t, long long k1d, long long v1t, long long v1d, int WT,
    int t0, float qscale, float* pm, float* pl, float* pacc, size_t o0, int NP) {
  constexpr int NT = NW * 32, DP = D + 1;
  float* s_q = sm;                  // [ROWS][D]
  float* s_x = s_q + ROWS * D;      // [TT][DP]
  float* s_p = s_x + TT * DP;       // [ROWS][TT]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int e = tid; e < ROWS * D; e += NT) {
    const int r = e / D, d = e % D;
    s_q[e] = vq_f(qh[(r / LQ) * qh1 + (r % LQ) * qh2 + d * qh3]) * qscale;
  }
  auto load = [&](bool values) {
    for (int e = tid; e < TT * D; e += NT) {
      const int t = e / D, d = e % D, tok = t0 + t;
      float x = 0.0f;
      if (tok < W0) x = vq_f(values ? v0[tok * v0t + d * v0d] : k0[tok * k0t + d * k0d]);
      else if (tok < WT) x = vq_f(values ? v1[(tok - W0) * v1t + d * v1d] : k1[(tok - W0) * k1t + d * k1d]);
      s_x[t * DP + d] = x;
    }
  };
  load(false);
  __syncthreads();
  static_assert(TT == 32, "a warp's lanes are the block's tokens");
  for (int r = warp; r < ROWS; r += NW) {
    float s = 0.0f;
#pragma unroll 8
    for (int d = 0; d < D; ++d) s += s_q[r * D + d] * s_x[lane * DP + d];
    s = t0 + lane < WT ? s : vq_ninf();
    const float m = vq_warp_max(s);
    const float p = exp2f(s - m);
    const float l = vq_warp_sum(p);
    s_p[r * TT + lane] = p;
    if (lane == 0) {
      pm[o0 + (size_t)r * NP] = m;
      pl[o0 + (size_t)r * NP] = l;
    }
  }
  __syncthreads();
  load(true);
  __syncthreads();
  for (int e = tid; e < ROWS * D; e += NT) {
    const int r = e / D, d = e % D;
    float a = 0.0f;
#pragma unroll 8
    for (int t = 0; t < TT; ++t) a += s_p[r * TT + t] * s_x[t * DP + d];
    pacc[(o0 + (size_t)r * NP) * D + d] = a;
  }
}

//@@ tc_fold_header
// After a block wrote its partials (rows bh*ROWS.., column of NP): count it; the
// head's last block merges the NP partials (exact softmax merge, as the reduce
// launch) into out [rows, D] (OT) and lse (natural log). Partials of other blocks
// are read through L2 (__ldcg: L1 is not coherent), many loads in flight per
// thread (the merge is on the launch's critical path): m and l once each, then
// float4 accumulators, G thread groups over the partials when a head's output
// has fewer float4s than the block has threads. Shared memory: ROWS * NP floats
// of weights, then G * C4 float4 sums.
template <int D, int ROWS, int NW, class OT>
__device__ __forceinline__ void vq_fold(float* sm, const int* cnt, int bh, int NP, const float* pm,
                                        const float* pl, const float* pacc, OT* out, float* lse) {
  constexpr int NT = NW * 32, C4 = ROWS * D / 4;
  constexpr int G = C4 >= NT ? 1 : NT / C4, NE = (C4 + NT - 1) / NT;
  constexpr int U = NE >= 4 ? 2 : NE >= 2 ? 4 : 8;  // partials per step: U * NE float4 loads in flight
  static_assert(D % 4 == 0, "float4 rows");
  __shared__ int s_last;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(const_cast<int*>(cnt) + bh, 1) == NP - 1;
  __syncthreads();
  if (!s_last) return;
  if (tid == 0) const_cast<int*>(cnt)[bh] = 0;  // zero again for the next launch
  __threadfence();
  float* s_w = sm;  // [ROWS][NP]: m, then each partial's weight exp2(m - M) / sum
  float4* s_sum = reinterpret_cast<float4*>(sm + (ROWS * NP + 3) / 4 * 4);  // [G][C4]
  const size_t row0 = (size_t)bh * ROWS;
  for (int r = warp; r < ROWS; r += NW) {
    const float* m = pm + (row0 + r) * NP;
    const float* l = pl + (row0 + r) * NP;
    float M = vq_ninf(), Ls = 0.0f;
    for (int s = lane; s < NP; s += 32) {
      const float x = __ldcg(m + s);
      s_w[r * NP + s] = x;
      M = fmaxf(M, x);
    }
    M = vq_warp_max(M);
    for (int s = lane; s < NP; s += 32) Ls += __ldcg(l + s) * exp2f(s_w[r * NP + s] - M);
    Ls = vq_warp_sum(Ls);
    for (int s = lane; s < NP; s += 32) s_w[r * NP + s] = exp2f(s_w[r * NP + s] - M) / Ls;
    if (lane == 0) lse[row0 + r] = (M + log2f(Ls)) * 0.69314718055994531f;
  }
  __syncthreads();
  const int grp = G > 1 ? tid / C4 : 0;
  float4 a[NE];
#pragma unroll
  for (int k = 0; k < NE; ++k) a[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (grp < G) {
    for (int s0 = grp * U; s0 < NP; s0 += G * U) {
      float4 x[NE][U];
#pragma unroll
      for (int k = 0; k < NE; ++k) {
        const int c = (G > 1 ? tid % C4 : tid) + k * NT, r = c / (D / 4);
#pragma unroll
        for (int u = 0; u < U; ++u)
          x[k][u] = c < C4 && s0 + u < NP
              ? __ldcg(reinterpret_cast<const float4*>(pacc + ((row0 + r) * NP + s0 + u) * D) + c % (D / 4))
              : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int k = 0; k < NE; ++k) {
        const int c = (G > 1 ? tid % C4 : tid) + k * NT, r = c < C4 ? c / (D / 4) : 0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const float w = s0 + u < NP ? s_w[r * NP + s0 + u] : 0.0f;
          a[k].x += w * x[k][u].x; a[k].y += w * x[k][u].y; a[k].z += w * x[k][u].z; a[k].w += w * x[k][u].w;
        }
      }
    }
  }
  if constexpr (G > 1) {  // the groups' sums -> group 0
    if (grp < G) s_sum[grp * C4 + tid % C4] = a[0];
    __syncthreads();
    if (tid < C4) {
#pragma unroll
      for (int g = 1; g < G; ++g) {
        const float4 y = s_sum[g * C4 + tid];
        a[0].x += y.x; a[0].y += y.y; a[0].z += y.z; a[0].w += y.w;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < NE; ++k) {
    const int c = tid + k * NT;
    if (c < C4) {
      OT* o = out + row0 * D + (size_t)c * 4;
      o[0] = static_cast<OT>(a[k].x); o[1] = static_cast<OT>(a[k].y);
      o[2] = static_cast<OT>(a[k].z); o[3] = static_cast<OT>(a[k].w);
    }
  }
}
