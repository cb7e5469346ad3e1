// Decode attention straight from Lloyd-Max codes (issue 18): the `lloydmax`
// store (per-token float16 norm + b-bit indices into a level table), with an
// optional `residual(lloydmax(...))` stage, for keys and for values.
//
// Read at run time by veloxquant/kernels/lut.py and bound with
// mx.fast.cuda_kernel (the body below is wrapped in a generated signature; the
// header of kernels/cuda/affine_attention.cu comes first: vq_f, vq_ninf,
// vq_warp_max, vq_warp_sum). It writes split-K partials in log2 units, merged
// by affine_attention.cu's `reduce` launch, exactly as the affine kernels do.
//
// The kernel works in the codec's transformed domain (after the Hadamard
// rotation): lut_attend rotates the query rows once in shared memory and
// lut_reduce rotates each output row back once, so no key or value is ever
// rotated or rebuilt in memory. Both rotations are float32 butterflies (MLX's
// CUDA matmul would round their inputs to TF32).

//@@ lut_header
// In-place Walsh-Hadamard butterfly over n floats of shared memory, by all NT
// threads of the block (n a power of two); the caller scales by 1/sqrt(n).
template <int NT>
__device__ __forceinline__ void vq_fwht(float* x, int n, int tid) {
  for (int h = 1; h < n; h *= 2) {
    __syncthreads();
    for (int i = tid; i < n / 2; i += NT) {
      const int a = (i / h) * 2 * h + i % h, b = a + h;
      const float u = x[a], v = x[b];
      x[a] = u + v;
      x[b] = u - v;
    }
  }
  __syncthreads();
}

//@@ lut_attend
  // inputs: q [B*Hkv, ROWS, D] f32 times scale*log2(e)/sqrt(D) (rotated here when KH);
  //   kc1 [B, Hkv, L, D*KB1/32] u32, kn1 [B, Hkv, L, 1] f16 (store); kc2, kn2 the
  //   residual's (the store's again when KB2 == 0, never read); vc1, vn1, vc2,
  //   vn2 the same for values; lv [4 * 256] f32: key store, key residual, value
  //   store, value residual levels (value levels already times 1/sqrt(D)).
  // outputs: pm, pl [B*Hkv*ROWS, NS], pacc [B*Hkv*ROWS, NS, D] (log2 units, unnormalised).
  // template: D, ROWS (<= 4), KB1, KB2, VB1, VB2 (bits; 0 = no residual), KH (keys
  //   Hadamard-rotated: 1/0), NW (warps)
  // Block blockIdx.x takes a run of tokens of kv head blockIdx.y; its warps take
  // 32 tokens at a time. Scores, lane = token: each code indexes a per-channel
  // table of (q[r][d] * level) for all rows at once (one float4 read per code).
  // Values, lanes over channels: each of the 32 tokens' codes is widened once
  // and added to every row with that token's probability (shuffled from its lane).
  constexpr int NT = NW * 32;
  constexpr int NK1 = 1 << KB1, NK2 = KB2 ? (1 << KB2) : 0;
  constexpr int NV1 = 1 << VB1, NV2 = VB2 ? (1 << VB2) : 0;
  constexpr int WK1 = D * KB1 / 32, WK2 = KB2 ? D * KB2 / 32 : 1;
  constexpr int WV1 = D * VB1 / 32, WV2 = VB2 ? D * VB2 / 32 : 1;
  constexpr int DC = D / 32;                          // value channels per lane
  constexpr int LUT_BYTES = D * (NK1 + NK2) * 16;
  constexpr int MERGE_BYTES = NW * 4 * D * 4;
  constexpr int RAW = LUT_BYTES > MERGE_BYTES ? LUT_BYTES : MERGE_BYTES;
  static_assert(ROWS >= 1 && ROWS <= 4, "rows");
  static_assert(32 % KB1 == 0 && 32 % VB1 == 0 && (KB2 == 0 || 32 % KB2 == 0) && (VB2 == 0 || 32 % VB2 == 0),
                "bits must divide 32");
  static_assert(D % 32 == 0, "head_dim");

  // The level tables while scoring; the warps' partials after the last token.
  __shared__ __align__(16) unsigned char s_raw[RAW];
  __shared__ float s_q[4 * D];
  __shared__ float s_vl[NV1 + NV2 + 1];
  __shared__ float s_m[NW * 4], s_l[NW * 4];
  float4* s_lut1 = reinterpret_cast<float4*>(s_raw);
  float4* s_lut2 = s_lut1 + D * NK1;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int bh = blockIdx.y;
  const int L = kc1_shape[2];
  const int NS = gridDim.x;
  const int tpb = ((L + NS - 1) / NS + 31) / 32 * 32;
  const int t_begin = blockIdx.x * tpb, t_end = min(L, t_begin + tpb);

  for (int i = tid; i < 4 * D; i += NT) s_q[i] = i < ROWS * D ? q[(size_t)bh * ROWS * D + i] : 0.0f;
  if constexpr (KH) {
    for (int r = 0; r < ROWS; ++r) vq_fwht<NT>(s_q + r * D, D, tid);
    for (int i = tid; i < ROWS * D; i += NT) s_q[i] *= rsqrtf((float)D);
  }
  __syncthreads();
  for (int i = tid; i < D * NK1; i += NT) {
    const int d = i / NK1;
    const float lev = lv[i % NK1];
    s_lut1[i] = make_float4(s_q[d] * lev, s_q[D + d] * lev, s_q[2 * D + d] * lev, s_q[3 * D + d] * lev);
  }
  if constexpr (KB2 > 0) {
    for (int i = tid; i < D * NK2; i += NT) {
      const int d = i / NK2;
      const float lev = lv[256 + i % NK2];
      s_lut2[i] = make_float4(s_q[d] * lev, s_q[D + d] * lev, s_q[2 * D + d] * lev, s_q[3 * D + d] * lev);
    }
  }
  for (int i = tid; i < NV1 + NV2; i += NT) s_vl[i] = i < NV1 ? lv[512 + i] : lv[768 + i - NV1];
  __syncthreads();

  const size_t base = (size_t)bh * L;
  float mrun[ROWS], lsum[ROWS], acc[ROWS][DC];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    mrun[r] = vq_ninf();
    lsum[r] = 0.0f;
#pragma unroll
    for (int k = 0; k < DC; ++k) acc[r][k] = 0.0f;
  }

  for (int c0 = t_begin + warp * 32; c0 < t_end; c0 += NT) {
    const int t = c0 + lane;
    const int nvalid = min(32, t_end - c0);
    const bool valid = lane < nvalid;
    float4 a1 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), a2 = a1;
    float kn1v = 0.0f, kn2v = 0.0f, vn1v = 0.0f, vn2v = 0.0f;
    if (valid) {
      const unsigned int* w1 = kc1 + (base + t) * WK1;
#pragma unroll 4
      for (int w = 0; w < WK1; ++w) {
        const unsigned int x = w1[w];
#pragma unroll
        for (int j = 0; j < 32 / KB1; ++j) {
          const float4 u = s_lut1[(w * (32 / KB1) + j) * NK1 + ((x >> (j * KB1)) & (NK1 - 1))];
          a1.x += u.x; a1.y += u.y; a1.z += u.z; a1.w += u.w;
        }
      }
      kn1v = vq_f(kn1[base + t]);
      vn1v = vq_f(vn1[base + t]);
      if constexpr (KB2 > 0) {
        const unsigned int* w2 = kc2 + (base + t) * WK2;
#pragma unroll 4
        for (int w = 0; w < WK2; ++w) {
          const unsigned int x = w2[w];
#pragma unroll
          for (int j = 0; j < 32 / KB2; ++j) {
            const float4 u = s_lut2[(w * (32 / KB2) + j) * NK2 + ((x >> (j * KB2)) & (NK2 - 1))];
            a2.x += u.x; a2.y += u.y; a2.z += u.z; a2.w += u.w;
          }
        }
        kn2v = vq_f(kn2[base + t]);
      }
      if constexpr (VB2 > 0) vn2v = vq_f(vn2[base + t]);
    }
    const float sc[4] = {kn1v * a1.x + kn2v * a2.x, kn1v * a1.y + kn2v * a2.y, kn1v * a1.z + kn2v * a2.z,
                         kn1v * a1.w + kn2v * a2.w};
    float p[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float cmax = vq_warp_max(valid ? sc[r] : vq_ninf());  // finite: the chunk has a token
      const float mnew = fmaxf(mrun[r], cmax);
      const float f = exp2f(mrun[r] - mnew);  // 0 on the first chunk (mrun = -inf)
      mrun[r] = mnew;
      lsum[r] *= f;
#pragma unroll
      for (int k = 0; k < DC; ++k) acc[r][k] *= f;
      p[r] = valid ? exp2f(sc[r] - mnew) : 0.0f;
      lsum[r] += p[r];
    }
    // Values: token j's probabilities and norms come from lane j.
#pragma unroll 2
    for (int j = 0; j < nvalid; ++j) {
      float pj[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) pj[r] = __shfl_sync(0xffffffffu, p[r], j);
      const float m1 = __shfl_sync(0xffffffffu, vn1v, j);
      const float m2 = VB2 > 0 ? __shfl_sync(0xffffffffu, vn2v, j) : 0.0f;
      const unsigned int* v1 = vc1 + (base + c0 + j) * WV1;
      const unsigned int* v2 = vc2 + (base + c0 + j) * WV2;
#pragma unroll
      for (int k = 0; k < DC; ++k) {
        const int d = lane + 32 * k;
        float v = m1 * s_vl[(v1[d * VB1 / 32] >> ((d * VB1) % 32)) & (NV1 - 1)];
        if constexpr (VB2 > 0) v += m2 * s_vl[NV1 + ((v2[d * VB2 / 32] >> ((d * VB2) % 32)) & (NV2 - 1))];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r][k] = fmaf(pj[r], v, acc[r][k]);
      }
    }
  }

  // Warp partials -> shared memory (the tables are no longer read), then one per block.
  __syncthreads();
  float* s_acc = reinterpret_cast<float*>(s_raw);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const float l = vq_warp_sum(lsum[r]);
    if (lane == 0) {
      s_m[warp * 4 + r] = mrun[r];
      s_l[warp * 4 + r] = l;
    }
#pragma unroll
    for (int k = 0; k < DC; ++k) s_acc[(warp * 4 + r) * D + lane + 32 * k] = acc[r][k];
  }
  __syncthreads();
  for (int e = tid; e < ROWS * D; e += NT) {
    const int r = e / D, d = e % D;
    float M = vq_ninf();
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, s_m[w * 4 + r]);
    float a = 0.0f, l = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float mw = s_m[w * 4 + r];
      const float f = mw == vq_ninf() ? 0.0f : exp2f(mw - M);  // a warp that got no token
      a += f * s_acc[(w * 4 + r) * D + d];
      l += f * s_l[w * 4 + r];
    }
    const size_t o = ((size_t)bh * ROWS + r) * NS + blockIdx.x;
    pacc[o * D + d] = a;
    if (d == 0) {
      pm[o] = M;
      pl[o] = l;
    }
  }

//@@ lut_reduce
  // affine_attention.cu's reduce for one whole row per block (D threads), then
  // the value side's Hadamard rotation back (VH = 1) on the merged row.
  // inputs: pm, pl [NROWS, NS], pacc [NROWS, NS, D]; outputs: out [NROWS, D] f32, lse [NROWS]
  // template: D, VH
  __shared__ float s_row[D];
  const int NS = pm_shape[1];
  // rows along x: CUDA caps a grid's y at 65,535 blocks
  const int row = blockIdx.x, d = threadIdx.x;
  const float* m = pm + (size_t)row * NS;
  const float* l = pl + (size_t)row * NS;
  float M = vq_ninf();
  for (int s = 0; s < NS; ++s) M = fmaxf(M, m[s]);
  float Ls = 0.0f, a = 0.0f;
  for (int s = 0; s < NS; ++s) {
    const float f = exp2f(m[s] - M);
    Ls += l[s] * f;
    a += pacc[((size_t)row * NS + s) * D + d] * f;
  }
  s_row[d] = a / Ls;
  if constexpr (VH) {
    vq_fwht<D>(s_row, D, d);
    s_row[d] *= rsqrtf((float)D);
  }
  out[(size_t)row * D + d] = s_row[d];
  // natural-log lse of the row's scores: (max + log2(sum)) * ln 2
  if (d == 0) lse[row] = (M + log2f(Ls)) * 0.69314718055994531f;

//@@ lloyd_encode
  // The `lloydmax` store's encode (and one lloydmax residual's), for decode steps
  // and prefill chunks: one block of D threads per token row. The same arithmetic as
  // stages/codebook.py's MLX ops, in float32 (the Hadamard rotation as a
  // butterfly; sums in another order, so a component within rounding of a
  // level boundary may take the neighbouring code).
  // inputs: x [R, D] (T), lv [2 * 256] f32 levels (store, residual)
  // outputs: c1 [R, D*B1/32] u32, n1 [R] f16, c2 [R, D*B2/32] u32, n2 [R] f16 (one word / norm when B2 = 0)
  // template: T, D, B1, B2 (0 = no residual), H (Hadamard first: 1/0)
  __shared__ float s_x[D];
  __shared__ float s_red[D / 32];
  __shared__ unsigned int s_w[D / 2 + 1];
  // rows along x: a prefill chunk's B*H*n rows pass y's cap of 65,535 blocks
  const int row = blockIdx.x, d = threadIdx.x, warp = d / 32, lane = d % 32;
  const float sqd = (float)sqrt((double)D);
  s_x[d] = vq_f(x[(size_t)row * D + d]);
  if constexpr (H) {
    vq_fwht<D>(s_x, D, d);
    s_x[d] *= 1.0f / sqd;  // x @ (Sylvester / sqrt(D)): exact scaling for D = 64, 256
  }
  float val = s_x[d];
#pragma unroll
  for (int stage = 0; stage < (B2 ? 2 : 1); ++stage) {
    const int bits = stage ? B2 : B1;
    const float* lev = lv + 256 * stage;
    // the stage's norm, rounded to float16 as it is stored
    float sq = vq_warp_sum(val * val);
    __syncthreads();
    if (lane == 0) s_red[warp] = sq;
    __syncthreads();
    float tot = 0.0f;
    for (int w = 0; w < D / 32; ++w) tot += s_red[w];
    const __half n16 = __float2half(sqrtf(tot));
    const float nf = __half2float(n16);
    const float unit = val * sqd / fmaxf(nf, 1e-12f);
    int code = 0;
    for (int i = 0; i + 1 < (1 << bits); ++i) code += unit > (lev[i + 1] + lev[i]) / 2.0f;
    if (d < D / 2 + 1) s_w[d] = 0u;
    __syncthreads();
    atomicOr(&s_w[d * bits / 32], (unsigned int)code << ((d * bits) % 32));
    __syncthreads();
    unsigned int* out_c = stage ? c2 : c1;
    __half* out_n = stage ? n2 : n1;
    if (d < D * bits / 32) out_c[(size_t)row * (D * bits / 32) + d] = s_w[d];
    if (d == 0) out_n[row] = n16;
    // what is left for the residual: x - decoded (level * norm / sqrt(D))
    val = val - lev[code] * nf / sqd;
  }
