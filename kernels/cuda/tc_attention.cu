// attend_tc: lean tensor-core decode attention over affine codes (issue 18).
//
// Same contract, inputs and partials as attend_mma (kernels/CONTRACT.md): keys
// per-channel, values per-token, one (max, sum, acc) partial per block in log2
// units, merged by the reduce / reduce_tail launches of affine_attention.cu.
// Bound by veloxquant/kernels/tc.py, after affine_attention.cu's header and
// mma_header sections (vq_cp16, vq_pair, vq_mma, ...).
//
// What differs from attend_mma (ncu on the H200: both execute 630-690 warp
// instructions per 16-token tile; attend_mma's warps wait on global loads,
// these do not, which made this one faster at 128k -- docs/kernels.md):
//   * values c*s+z and the probabilities are single fp16 operands (one
//     rounding each, as fp16 SDPA over the decoded cache has); key codes are
//     exact and the key scales are folded into the query per key group as an
//     exact fp16 hi + lo pair -- the lo half in the mma's spare rows when a kv
//     head has <= 8 rows, so scores cost one mma per product;
//   * scores come out of mma as (row, token) -- A = q*s (16 rows), B = key
//     codes -- which is exactly the B operand of P^T for the value mma
//     (A = V^T, 16 channels): no shuffle between softmax and values;
//   * every warp streams its own run of 32-token stages through NST
//     shared-memory buffers with cp.async (no block barrier in the loop);
//   * the q.z bias of a key group is one mma per k-step (A = q, B = z pairs)
//     added as the score accumulator's start value.

//@@ tc_header
// The copies below when the source is not 16-byte aligned (a sliced view): 4-byte
// cp.async when 4-byte aligned, else plain 2-byte copies (visible after the
// caller's __syncwarp). Out of line: the hot loop's code stays small.
__device__ __noinline__ void vq_warp_rows_slow(unsigned char* dst, const unsigned char* src, int rows, int rb,
                                               int ds, int lane) {
  if ((rb % 4) == 0 && (reinterpret_cast<unsigned long long>(src) & 3ull) == 0) {
    const int p = rb / 4;
    for (int i = lane; i < rows * p; i += 32) vq_cp4(dst + (i / p) * ds + (i % p) * 4, src + (size_t)i * 4);
  } else {
    const int p = rb / 2;
    for (int i = lane; i < rows * p; i += 32)
      *reinterpret_cast<unsigned short*>(dst + (i / p) * ds + (i % p) * 2) =
          *reinterpret_cast<const unsigned short*>(src + (size_t)i * 2);
  }
}

// Rows of RB bytes, contiguous at src, into rows DS bytes apart in shared
// memory, by the 32 lanes of one warp: 16-byte cp.async when the source allows.
template <int RB, int DS>
__device__ __forceinline__ void vq_warp_rows(unsigned char* dst, const unsigned char* src, int rows, int lane) {
  if (RB % 16 == 0 && (reinterpret_cast<unsigned long long>(src) & 15ull) == 0) {
    constexpr int P = RB / 16 > 0 ? RB / 16 : 1;
    for (int i = lane; i < rows * P; i += 32) vq_cp16(dst + (i / P) * DS + (i % P) * 16, src + (size_t)i * 16);
  } else {
    vq_warp_rows_slow(dst, src, rows, RB, DS, lane);
  }
}

// A full stage's N rows of RB bytes (16-byte aligned source) into rows DS apart:
// the trip count and each lane's offsets are constants (a lane's pieces are
// 32 / P rows apart), so a copy is one cp.async on a fixed offset -- the general
// loop above spent ~15 instructions of address arithmetic per copy (PTX).
template <int RB, int DS, int N>
__device__ __forceinline__ void vq_warp_rows_full(unsigned char* dst, const unsigned char* src, int lane) {
  constexpr int P = RB / 16, PIECES = N * P;
  static_assert(RB % 16 == 0 && P <= 32 && 32 % P == 0, "whole 16-byte pieces, a power of two per row");
  unsigned char* d = dst + (lane / P) * DS + (lane % P) * 16;
  const unsigned char* s = src + lane * 16;
#pragma unroll
  for (int k = 0; k < (PIECES + 31) / 32; ++k)
    if (PIECES % 32 == 0 || lane + 32 * k < PIECES) vq_cp16(d + k * (32 / P) * DS, s + k * 512);
}

// The fp16 pair (x[a], x[b]) of an fp16 row in shared memory, read as words.
__device__ __forceinline__ unsigned int vq_hpair(const unsigned int* w, int a, int b) {
  return __byte_perm(w[a / 2], w[b / 2], ((a & 1) ? 0x32 : 0x10) | (((b & 1) ? 0x76 : 0x54) << 8));
}

//@@ attend_tc
  // constants (tc_launch.py writes them first): T, D, ROWS, LQ, BK, GK, BV, GV, QSCALE, NW,
  // NST, KRS, VRS (code rows' smem strides), NX (dense tail tiers); header: VQ_FOLD (merge
  // in this launch: tc_fold.cu), VQ_NX, VQ_COUNTERS.
  // inputs: q [B, Hq, LQ, D], codes / scales / zeros (any batch and head strides, a head's
  // rows contiguous); VQ_FOLD: work (int32: VQ_COUNTERS counters, zero between launches,
  // then the partials), after (unused: orders the launches sharing work); xk0, xv0 (, xk1,
  // xv1): NX dense tail tiers, any strides.
  // grid (NP * NW * 32, B * Hkv): NS code blocks, then the tail's blocks (32 tokens each).
  // outputs: VQ_FOLD: out [B, Hq, LQ, D] (q's dtype with a tail, else float32), lse; else
  // partials pm, pl [B*Hkv*ROWS, NP], pacc [.., NP, D].
  constexpr int ST = 32;                    // tokens per stage: two 16-token tiles
  constexpr bool HI = ROWS > 8;             // mma rows g + 8 hold real rows
  constexpr int RP = HI ? 16 : 8;
  constexpr int KRB = D * BK / 8;           // key code bytes per token
  constexpr int VRB = D * BV / 8;           // value code bytes per token (rows VRS apart in smem)
  constexpr int NGV = D / GV;               // value groups per token
  constexpr int KG = ST >= GK ? ST / GK : 1;  // key scale rows a stage holds
  constexpr int O_VC = ST * KRS;
  constexpr int O_KS = O_VC + ST * VRS;
  constexpr int O_KZ = O_KS + KG * D * 2;
  constexpr int O_VS = O_KZ + KG * D * 2;
  constexpr int O_VZ = O_VS + ST * NGV * 2;
  constexpr int SB = (O_VZ + ST * NGV * 2 + 15) / 16 * 16;  // bytes of one stage
  constexpr int KBB = KRB / 4;              // key bytes of a lane block (channels [tig*D/4, +D/4))
  constexpr int KWN = KBB / 4;
  constexpr int KPP = 16 / BK;              // code pairs per word
  constexpr int KP = D / 8;                 // pairs per lane block: b0b1 / b2b3 of D/16 k-steps
  constexpr int CPT = D / 8;                // value channels of a lane block (g)
  constexpr int VNB = CPT * BV / 8;         // their bytes per token (2..32)
  constexpr int VWN = VNB >= 4 ? VNB / 4 : 1;
  constexpr int VPW = 32 / BV, VPP = 16 / BV;
  constexpr int NGT = CPT > GV ? CPT / GV : 1;  // value groups of a lane block
  constexpr int VT = D / 16;                // value m-tiles
  static_assert(ROWS >= 1 && ROWS <= 16 && KWN >= 1 && GK % 16 == 0 && GV >= 8 && NGV <= 32, "scope");
  static_assert(NST >= 2 && VRS % 16 == 0 && VRS >= VRB && KRS % 16 == 0 && KRS >= KRB, "stages");

  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ __align__(16) unsigned int s_q[32][KP * (HI ? 2 : 1)];   // each lane's q pairs (rows g, g+8)
  __shared__ __align__(16) unsigned int s_qr[32][KP * (HI ? 2 : 1)];  // float q: what fp16 rounding left off
  __shared__ float s_m[NW][RP], s_l[NW][RP];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tig = lane % 4;
  const int bh = blockIdx.y, bx = blockIdx.x;
  const int HKV = kc_shape[1], L = kc_shape[2], bb = bh / HKV, hh = bh % HKV;
#if VQ_NX > 1
  const int W0 = xk0_shape[2], WT = W0 + xk1_shape[2];
#elif VQ_NX > 0
  const int W0 = xk0_shape[2], WT = W0;
#else
  const int WT = 0;
#endif
  const int NP = gridDim.x, NS = NP - (WT + 31) / 32;
#if VQ_FOLD
  const size_t NM = ((size_t)gridDim.y * ROWS * NP + 3) / 4 * 4;  // 16-byte aligned runs: the merge reads float4s
  float* pm = reinterpret_cast<float*>(const_cast<int*>(work) + VQ_COUNTERS);
  float* pl = pm + NM;
  float* pacc = pl + NM;
#endif
  const T* qh = q + bb * q_strides[0] + hh * (ROWS / LQ) * q_strides[1];
  // A head's code, scale and zero rows must be contiguous (a view cut along tokens is):
  // otherwise the head's partials are NaN, never a silent misread.
  const bool rows_ok = (kc_strides[3] == 1 && (L == 1 || kc_strides[2] == KRB / 4)) &&
      (vc_strides[3] == 1 && (L == 1 || vc_strides[2] == VRB / 4)) &&
      (ks_strides[3] == 1 && (ks_shape[2] == 1 || ks_strides[2] == D)) &&
      (kz_strides[3] == 1 && (kz_shape[2] == 1 || kz_strides[2] == D)) &&
      (vs_strides[3] == 1 && (L == 1 || vs_strides[2] == NGV)) && (vz_strides[3] == 1 && (L == 1 || vz_strides[2] == NGV));
  if (bx < NS) {  // a code block (body not indented: the tail block's branch follows it)
  const int nst = (L + ST - 1) / ST;
  const int spb = (nst + NS - 1) / NS;
  const int b0 = bx * spb, b1 = min(b0 + spb, nst);
  const int spw = (b1 - b0 + NW - 1) / NW;
  const int s0 = min(b0 + warp * spw, b1), s1 = rows_ok ? min(s0 + spw, b1) : s0;

  // q pairs in this lane's channel order (the A operand's columns = the key
  // block's pairs): pair P of block tig = channels (cA, cA + KPP).
  if (warp == 0) {
#pragma unroll
    for (int h = 0; h < (HI ? 2 : 1); ++h) {
      const int r = g + 8 * h;
#pragma unroll
      for (int P = 0; P < KP; ++P) {
        const int ca = tig * (D / 4) + (P / KPP) * 2 * KPP + P % KPP;
        float xa = 0.0f, xb = 0.0f;
        if (r < ROWS) {
          const T* qr = qh + (r / LQ) * q_strides[1] + (r % LQ) * q_strides[2];
          xa = vq_g(qr[ca * q_strides[3]]);
          xb = vq_g(qr[(ca + KPP) * q_strides[3]]);
        }
        const __half2 hq = __floats2half2_rn(xa, xb);
        const float2 f = __half22float2(hq);
        s_q[lane][h * KP + P] = vq_u(hq);
        s_qr[lane][h * KP + P] = vq_u(__floats2half2_rn(xa - f.x, xb - f.y));
      }
    }
  }
  __syncthreads();

  unsigned char* wbuf = smem + warp * NST * SB;
#define VQ_HEAD(x) reinterpret_cast<const unsigned char*>(x + bb * x##_strides[0] + hh * x##_strides[1])
  const unsigned char *kcb = VQ_HEAD(kc), *vcb = VQ_HEAD(vc), *ksb = VQ_HEAD(ks), *kzb = VQ_HEAD(kz);
  const unsigned char *vsb = VQ_HEAD(vs), *vzb = VQ_HEAD(vz);
#undef VQ_HEAD

  // Full stages from 16-byte aligned sources take constant-shaped copies (all
  // stage offsets are multiples of 16 when the heads' starts are).
  constexpr bool WHOLE = KRB % 16 == 0 && VRB % 16 == 0 && 32 % (KRB / 16 + !KRB) == 0 && KRB <= 512 &&
                         32 % (VRB / 16 + !VRB) == 0 && VRB <= 512 && (KG * D * 2) % 16 == 0 && (ST * NGV * 2) % 16 == 0;
  const bool whole = WHOLE && ((reinterpret_cast<unsigned long long>(kcb) | reinterpret_cast<unsigned long long>(vcb) |
                                reinterpret_cast<unsigned long long>(ksb) | reinterpret_cast<unsigned long long>(kzb) |
                                reinterpret_cast<unsigned long long>(vsb) | reinterpret_cast<unsigned long long>(vzb)) & 15ull) == 0;
  auto issue = [&](int st, int slot) {
    unsigned char* b = wbuf + slot * SB;
    const int t0 = st * ST, nt = min(ST, L - t0);
    if constexpr (WHOLE) {
      if (whole && nt == ST) {
        vq_warp_rows_full<KRB, KRS, ST>(b, kcb + (size_t)t0 * KRB, lane);
        vq_warp_rows_full<VRB, VRS, ST>(b + O_VC, vcb + (size_t)t0 * VRB, lane);
        vq_warp_rows_full<16, 16, KG * D * 2 / 16>(b + O_KS, ksb + (size_t)(t0 / GK) * D * 2, lane);
        vq_warp_rows_full<16, 16, KG * D * 2 / 16>(b + O_KZ, kzb + (size_t)(t0 / GK) * D * 2, lane);
        vq_warp_rows_full<16, 16, ST * NGV * 2 / 16>(b + O_VS, vsb + (size_t)t0 * NGV * 2, lane);
        vq_warp_rows_full<16, 16, ST * NGV * 2 / 16>(b + O_VZ, vzb + (size_t)t0 * NGV * 2, lane);
        return;
      }
    }
    vq_warp_rows<KRB, KRS>(b, kcb + (size_t)t0 * KRB, nt, lane);
    vq_warp_rows<VRB, VRS>(b + O_VC, vcb + (size_t)t0 * VRB, nt, lane);
    // Scales and zeros are contiguous runs (whole 16-byte pieces: nt is a multiple of 16).
    const int g0 = t0 / GK, ng = nt >= GK ? nt / GK : 1;
    vq_warp_rows<16, 16>(b + O_KS, ksb + (size_t)g0 * D * 2, ng * D * 2 / 16, lane);
    vq_warp_rows<16, 16>(b + O_KZ, kzb + (size_t)g0 * D * 2, ng * D * 2 / 16, lane);
    vq_warp_rows<16, 16>(b + O_VS, vsb + (size_t)t0 * NGV * 2, nt * NGV * 2 / 16, lane);
    vq_warp_rows<16, 16>(b + O_VZ, vzb + (size_t)t0 * NGV * 2, nt * NGV * 2 / 16, lane);
  };
#pragma unroll 1
  for (int i = 0; i < NST - 1; ++i) {
    if (s0 + i < s1) issue(s0 + i, i);
    vq_commit();
  }

  const float qsc = __int_as_float(QSCALE);
  float acc[HI ? 2 : 1][VT][4];
#pragma unroll
  for (int h = 0; h < (HI ? 2 : 1); ++h)
#pragma unroll
    for (int i = 0; i < VT; ++i) acc[h][i][0] = acc[h][i][1] = acc[h][i][2] = acc[h][i][3] = 0.0f;
  float mrun[2] = {vq_minf(), vq_minf()}, lsum[2] = {0.0f, 0.0f};
  // q*s of the current key group as fp16 pairs hi + lo (exact for fp16 q): rows g, g+8.
  // With <= 8 rows the lo pairs ride in the mma's spare rows 8..15 (no extra mma).
  unsigned int qs[2][KP], ql[2][KP];
  float bias[2] = {0.0f, 0.0f};
  int grp = -1;

  for (int st = s0; st < s1; ++st) {
    if (st + NST - 1 < s1) issue(st + NST - 1, (st - s0 + NST - 1) % NST);
    vq_commit();
    vq_wait<NST - 1>();
    __syncwarp();
    const unsigned char* b = wbuf + ((st - s0) % NST) * SB;
    const int ntile = min(ST, L - st * ST) / 16;
    for (int tl = 0; tl < ntile; ++tl) {
      const int T0 = st * ST + tl * 16;
      // Key group change: q*s pairs and the q.z bias (one mma per k-step).
      if (T0 / GK != grp) {
        grp = T0 / GK;
        const int kr = KG > 1 ? (tl * 16) / GK : 0;
        // this lane block's scales / zeros (D/4 fp16 each), read a chunk of KPP pairs
        // (2 KPP channels, 4 KPP bytes) at a time as vectors, as are the q pairs.
        const unsigned char* sw = b + O_KS + kr * D * 2 + tig * (D / 2);
        const unsigned char* zw = b + O_KZ + kr * D * 2 + tig * (D / 2);
        float bz[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        unsigned int sc_[KPP], zc_[KPP], qc_[2][KPP], rc_[2][KPP];
#pragma unroll
        for (int ks_ = 0; ks_ < D / 16; ++ks_) {
          unsigned int zp[2], qa[2][2], qr[2][2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int P = 2 * ks_ + e, j = P % KPP;  // pair j of chunk P / KPP: channels (j, j + KPP)
            if (j == 0) {
              vq_ld<4 * KPP>(sc_, sw + (P / KPP) * 4 * KPP);
              vq_ld<4 * KPP>(zc_, zw + (P / KPP) * 4 * KPP);
#pragma unroll
              for (int h = 0; h < (HI ? 2 : 1); ++h) {
                vq_ld<4 * KPP>(qc_[h], reinterpret_cast<const unsigned char*>(&s_q[lane][h * KP + P]));
                if constexpr (vq_is_f32<T>::value)
                  vq_ld<4 * KPP>(rc_[h], reinterpret_cast<const unsigned char*>(&s_qr[lane][h * KP + P]));
              }
            }
            const __half2 s2 = vq_h2(vq_hpair(sc_, j, j + KPP));
            zp[e] = vq_hpair(zc_, j, j + KPP);
#pragma unroll
            for (int h = 0; h < (HI ? 2 : 1); ++h) {
              qa[h][e] = qc_[h][j];
              const __half2 hi = __hmul2(vq_h2(qa[h][e]), s2);
              __half2 lo = __hfma2(vq_h2(qa[h][e]), s2, __hneg2(hi));
              if constexpr (vq_is_f32<T>::value) {
                qr[h][e] = rc_[h][j];
                lo = __hfma2(vq_h2(qr[h][e]), s2, lo);
              }
              qs[h][P] = vq_u(hi);
              ql[h][P] = vq_u(lo);
            }
          }
          if constexpr (HI) vq_mma(bz, qa[0][0], qa[1][0], qa[0][1], qa[1][1], zp[0], zp[1]);
          else vq_mma(bz, qa[0][0], 0u, qa[0][1], 0u, zp[0], zp[1]);
          if constexpr (vq_is_f32<T>::value) {
            if constexpr (HI) vq_mma(bz, qr[0][0], qr[1][0], qr[0][1], qr[1][1], zp[0], zp[1]);
            else vq_mma(bz, qr[0][0], 0u, qr[0][1], 0u, zp[0], zp[1]);
          }
        }
        bias[0] = bz[0];
        bias[1] = bz[2];
      }

      // Scores (rows g, g+8) x (tokens 2tig, 2tig+1) of n-tile n = tokens 8n + [0, 8),
      // in two accumulators per n-tile (sc, sc2): four dependent mma chains, not two.
      float sc[2][4], sc2[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        unsigned int kw[KWN];
        vq_ld<KBB>(kw, b + (tl * 16 + 8 * n + g) * KRS + tig * KBB);
        sc[n][0] = sc[n][1] = bias[0];
        sc[n][2] = sc[n][3] = HI ? bias[1] : 0.0f;
        sc2[n][0] = sc2[n][1] = sc2[n][2] = sc2[n][3] = 0.0f;
#pragma unroll
        for (int ks_ = 0; ks_ < D / 16; ++ks_) {
          const int Pa = 2 * ks_, Pb = 2 * ks_ + 1;
          const unsigned int k0 = vq_pair<BK>(kw[Pa / KPP], Pa % KPP), k1 = vq_pair<BK>(kw[Pb / KPP], Pb % KPP);
          if constexpr (HI) {
            vq_mma(sc[n], qs[0][Pa], qs[1][Pa], qs[0][Pb], qs[1][Pb], k0, k1);
            vq_mma(sc2[n], ql[0][Pa], ql[1][Pa], ql[0][Pb], ql[1][Pb], k0, k1);
          } else {
            vq_mma((ks_ & 1) ? sc2[n] : sc[n], qs[0][Pa], ql[0][Pa], qs[0][Pb], ql[0][Pb], k0, k1);
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) sc[n][i] += sc2[n][i];
      }
      // Online softmax per row, lazily rescaled (only when a max grows by > 2^8).
      unsigned int pb[2][2];  // P^T operand: (tokens 2tig, 2tig+1) and (+8, +9) of rows g, g+8
#pragma unroll
      for (int h = 0; h < (HI ? 2 : 1); ++h) {
        // (without HI, a row's score is its hi row g plus its lo row g + 8)
        const float x0 = (HI ? sc[0][2 * h] : sc[0][0] + sc[0][2]) * qsc;
        const float x1 = (HI ? sc[0][2 * h + 1] : sc[0][1] + sc[0][3]) * qsc;
        const float x2 = (HI ? sc[1][2 * h] : sc[1][0] + sc[1][2]) * qsc;
        const float x3 = (HI ? sc[1][2 * h + 1] : sc[1][1] + sc[1][3]) * qsc;
        float tmax = fmaxf(fmaxf(x0, x1), fmaxf(x2, x3));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
        const bool need = tmax > mrun[h] + 8.0f;
        if (__any_sync(0xffffffffu, need)) {
          const float mnew = need ? tmax : mrun[h];
          const float f = vq_ex2(mrun[h] - mnew);  // for rows g (+8 h)
          mrun[h] = mnew;
          lsum[h] *= f;
          // acc's columns are rows 2tig, 2tig+1 (+8 h): their factors live in lanes 4r.
          const float fa = __shfl_sync(0xffffffffu, f, 8 * tig), fb = __shfl_sync(0xffffffffu, f, 8 * tig + 4);
#pragma unroll
          for (int i = 0; i < VT; ++i) {
            acc[h][i][0] *= fa; acc[h][i][2] *= fa;
            acc[h][i][1] *= fb; acc[h][i][3] *= fb;
          }
        }
        const float p0 = vq_ex2(x0 - mrun[h]), p1 = vq_ex2(x1 - mrun[h]);
        const float p2 = vq_ex2(x2 - mrun[h]), p3 = vq_ex2(x3 - mrun[h]);
        lsum[h] += (p0 + p1) + (p2 + p3);
        pb[h][0] = vq_u(__floats2half2_rn(p0, p1));
        pb[h][1] = vq_u(__floats2half2_rn(p2, p3));
      }

      // Values: A = V^T (16 channels x 16 tokens): channels 2i, 2i+1 of lane block g,
      // tokens (2tig, 2tig+1) and (2tig+8, 2tig+9), decoded to fp16 as c*s+z.
      unsigned int x[2][2][VWN];  // [token pair][lo/hi halves][word]
      __half2 sp[2][NGT], zp[2][NGT];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int ta = tl * 16 + 2 * tig + 8 * e;
        unsigned int wa[VWN], wb[VWN];
        if constexpr (VNB >= 4) {
          vq_ld<VNB>(wa, b + O_VC + ta * VRS + g * VNB);
          vq_ld<VNB>(wb, b + O_VC + (ta + 1) * VRS + g * VNB);
        } else {
          wa[0] = *reinterpret_cast<const unsigned short*>(b + O_VC + ta * VRS + g * VNB);
          wb[0] = *reinterpret_cast<const unsigned short*>(b + O_VC + (ta + 1) * VRS + g * VNB);
        }
#pragma unroll
        for (int k = 0; k < VWN; ++k) {
          x[e][0][k] = __byte_perm(wa[k], wb[k], 0x5410);
          x[e][1][k] = __byte_perm(wa[k], wb[k], 0x7632);
        }
        const unsigned short* vsr = reinterpret_cast<const unsigned short*>(b + O_VS);
        const unsigned short* vzr = reinterpret_cast<const unsigned short*>(b + O_VZ);
#pragma unroll
        for (int u = 0; u < NGT; ++u) {
          const int j = (g * CPT) / GV + u;
          sp[e][u] = vq_h2(vsr[ta * NGV + j] | ((unsigned int)vsr[(ta + 1) * NGV + j] << 16));
          zp[e][u] = vq_h2(vzr[ta * NGV + j] | ((unsigned int)vzr[(ta + 1) * NGV + j] << 16));
        }
      }
#pragma unroll
      for (int i = 0; i < VT; ++i) {
        unsigned int a[4];  // (ch 2i, tok ab), (ch 2i+1, tok ab), (ch 2i, tok cd), (ch 2i+1, tok cd)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int c = 2 * i + (r & 1), e = r >> 1;
          const int w = c / VPW, qq = c % VPW;
          const unsigned int xx = x[e][qq / VPP][w];
          const int u = NGT > 1 ? c / GV : 0;
          a[r] = vq_u(__hfma2(vq_h2(vq_pair<BV>(xx, qq % VPP)), sp[e][u], zp[e][u]));
        }
        vq_mma(acc[0][i], a[0], a[1], a[2], a[3], pb[0][0], pb[0][1]);
        if constexpr (HI) vq_mma(acc[1][i], a[0], a[1], a[2], a[3], pb[1][0], pb[1][1]);
      }
    }
    __syncwarp();
  }
  vq_wait<0>();

  // Warp partials -> shared memory (over the drained stages), then one block partial.
  __syncthreads();
  float* s_acc = reinterpret_cast<float*>(smem);  // [NW][RP][D]
#pragma unroll
  for (int h = 0; h < (HI ? 2 : 1); ++h) {
#pragma unroll
    for (int i = 0; i < VT; ++i) {
      const int ca = g * CPT + 2 * i;  // rows g / g+8 of m-tile i = channels 2i / 2i+1 of block g
      float* wa = s_acc + ((size_t)warp * RP + 8 * h + 2 * tig) * D;
      wa[ca] = acc[h][i][0];
      wa[D + ca] = acc[h][i][1];
      wa[ca + 1] = acc[h][i][2];
      wa[D + ca + 1] = acc[h][i][3];
    }
    float l = lsum[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (tig == 0) {
      s_m[warp][g + 8 * h] = mrun[h];
      s_l[warp][g + 8 * h] = l;
    }
  }
  __syncthreads();
  for (int e = tid; e < ROWS * D; e += NW * 32) {
    const int r = e / D, d = e % D;
    float M = vq_minf();
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, s_m[w][r]);
    float a = 0.0f, l = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float mw = s_m[w][r];
      const float f = mw == vq_minf() ? 0.0f : exp2f(mw - M);
      a += f * s_acc[((size_t)w * RP + r) * D + d];
      l += f * s_l[w][r];
    }
    const size_t o = ((size_t)bh * ROWS + r) * NP + bx;
    pacc[o * D + d] = rows_ok ? a : __int_as_float(0x7fc00000);
    if (d == 0) {
      pm[o] = M;
      pl[o] = rows_ok ? l : __int_as_float(0x7fc00000);
    }
  }
  }
#if VQ_NX > 0
  else {  // a block of the dense tail (tc_fold.cu); tier 1 stands in for tier 0 when absent
#if VQ_NX > 1
    const auto *k1 = xk1, *v1 = xv1;
    const auto &k1s = xk1_strides, &v1s = xv1_strides;
#else
    const auto *k1 = xk0, *v1 = xv0;
    const auto &k1s = xk0_strides, &v1s = xv0_strides;
#endif
    vq_tail_partial<D, ROWS, LQ, NW, 32>(
        reinterpret_cast<float*>(smem), qh, q_strides[1], q_strides[2], q_strides[3],
        xk0 + bb * xk0_strides[0] + hh * xk0_strides[1], xv0 + bb * xv0_strides[0] + hh * xv0_strides[1],
        xk0_strides[2], xk0_strides[3], xv0_strides[2], xv0_strides[3], W0,
        k1 + bb * k1s[0] + hh * k1s[1], v1 + bb * v1s[0] + hh * v1s[1], k1s[2], k1s[3], v1s[2], v1s[3], WT,
        (bx - NS) * 32, __int_as_float(QSCALE), pm, pl, pacc, (size_t)bh * ROWS * NP + bx, NP);
  }
#endif
#if VQ_FOLD
  vq_fold<D, ROWS, NW>(reinterpret_cast<float*>(smem), work, bh, NP, pm, pl, pacc, out, lse);
#endif
