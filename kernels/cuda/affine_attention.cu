// Fused split-K decode attention over veloxquant's affine codec storage.
//
// Read at run time by veloxquant/kernels/cuda.py and bound with
// mx.fast.cuda_kernel, which wraps each body below in a generated
// `__global__ void f(inputs..., outputs...)` signature, declares the template
// arguments as constexprs and puts the header before it. Sections are split on
// the "//@@ name" marker lines. Contract, format and dispatch rules:
// kernels/CONTRACT.md.
//
// Two kernels per call:
//   attend  -- one block per (run of CH-token chunks, batch x kv head, row
//              block). Double-buffers each chunk's packed codes + fp16
//              scales/zeros into shared memory with cp.async (chunk i+1 lands
//              while chunk i is used), scores every row of the block, softmaxes
//              the chunk, accumulates V, and writes the chunk's (max, sum,
//              unnormalized acc) in log2 units.
//   reduce  -- merges the chunks of each row exactly (flash-decoding).
// Dequantized K/V never exist in memory: codes are widened in registers.

//@@ header

// The binding prepends "#define VQ_LAUNCH_BOUNDS threads, min_blocks" for the
// attend kernel: mx.fast.cuda_kernel generates the signature itself, so the
// launch bounds (the register cap that keeps 4 blocks resident per SM) ride
// on the __global__ keyword of the one kernel this source defines.
#ifdef VQ_LAUNCH_BOUNDS
#undef __global__
#define __global__ __location__(global) __launch_bounds__(VQ_LAUNCH_BOUNDS)
#endif

// Prefixed names: the body lives in namespace mlx::core::cu, whose own helpers
// would otherwise shadow ours in unqualified lookup.
__device__ __forceinline__ float vq_f(float x) { return x; }
__device__ __forceinline__ float vq_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float vq_f(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float vq_ninf() { return __int_as_float(0xff800000); }

// Code i of a packed word widened to the float 1 + code * 2^-B, exactly: the
// code is moved to the top B bits of a 1.0f mantissa (one shift + one lop3, no
// int->float conversion). Callers fold the 2^B and the 1.0 into per-group
// constants, so the offset costs no instruction per element.
template <int B>
__device__ __forceinline__ float vq_code(unsigned int w, int i) {
  const int sh = 23 - B - i * B;
  const unsigned int v = sh >= 0 ? (w << sh) : (w >> (-sh));
  return __uint_as_float((v & (((1u << B) - 1u) << (23 - B))) | 0x3F800000u);
}

template <int N>
__device__ __forceinline__ void vq_load_words(unsigned int (&w)[N], const unsigned int* p) {
  if constexpr (N == 4) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w;
  } else if constexpr (N == 2) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    w[0] = u.x; w[1] = u.y;
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) w[k] = p[k];
  }
}

template <int N>
__device__ __forceinline__ void vq_load_floats(float (&x)[N], const float* p) {
  if constexpr (N == 4) {
    const float4 u = *reinterpret_cast<const float4*>(p);
    x[0] = u.x; x[1] = u.y; x[2] = u.z; x[3] = u.w;
  } else if constexpr (N == 2) {
    const float2 u = *reinterpret_cast<const float2*>(p);
    x[0] = u.x; x[1] = u.y;
  } else {
    x[0] = p[0];
  }
}

__device__ __forceinline__ void vq_cp16(unsigned char* dst, const unsigned char* src) {
  const unsigned int d = static_cast<unsigned int>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void vq_cp4(unsigned char* dst, const unsigned char* src) {
  const unsigned int d = static_cast<unsigned int>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void vq_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void vq_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Global -> shared copy of nbytes (even). Asynchronous in 16- or 4-byte pieces
// when the source allows (a sliced view may start anywhere); a plain copy of
// 2-byte pieces otherwise, visible after the caller's __syncthreads.
__device__ __forceinline__ void vq_stage(unsigned char* dst, const unsigned char* src, int nbytes,
                                         int tid, int nt) {
  const unsigned long long a = reinterpret_cast<unsigned long long>(src) | static_cast<unsigned>(nbytes);
  if ((a & 15ull) == 0) {
    for (int i = tid * 16; i < nbytes; i += nt * 16) vq_cp16(dst + i, src + i);
  } else if ((a & 3ull) == 0) {
    for (int i = tid * 4; i < nbytes; i += nt * 4) vq_cp4(dst + i, src + i);
  } else {
    for (int i = tid * 2; i < nbytes; i += nt * 2)
      *reinterpret_cast<unsigned short*>(dst + i) = *reinterpret_cast<const unsigned short*>(src + i);
  }
}

// Sum R per-lane row partials over the TPT lanes of a token team. A
// reduce-scatter first (each step halves the rows a lane keeps: 3 shuffles for
// 4 rows instead of 4 x log2(TPT)), then a plain butterfly. Afterwards lane li
// holds, in v[0], the full sum of row li / (TPT / R).
template <int R, int TPT>
__device__ __forceinline__ void vq_team_reduce(float (&v)[R], int li) {
  if constexpr (R == 4) {
    const bool hi = li & (TPT / 2);
    const float s0 = hi ? v[0] : v[2], k0 = hi ? v[2] : v[0];
    const float s1 = hi ? v[1] : v[3], k1 = hi ? v[3] : v[1];
    const float a0 = k0 + __shfl_xor_sync(0xffffffffu, s0, TPT / 2);
    const float a1 = k1 + __shfl_xor_sync(0xffffffffu, s1, TPT / 2);
    const bool hi2 = li & (TPT / 4);
    const float s2 = hi2 ? a0 : a1, k2 = hi2 ? a1 : a0;
    v[0] = k2 + __shfl_xor_sync(0xffffffffu, s2, TPT / 4);
  } else if constexpr (R == 2) {
    const bool hi = li & (TPT / 2);
    const float s0 = hi ? v[0] : v[1], k0 = hi ? v[1] : v[0];
    v[0] = k0 + __shfl_xor_sync(0xffffffffu, s0, TPT / 2);
  }
#pragma unroll
  for (int off = TPT / (2 * R); off >= 1; off /= 2) v[0] += __shfl_xor_sync(0xffffffffu, v[0], off);
}

__device__ __forceinline__ float vq_warp_max(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ float vq_warp_sum(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

//@@ attend
  // inputs: q [B*Hkv, ROWS, D] (T), kc/vc uint32 codes [B, Hkv, L, D*B/32],
  //   ks/kz, vs/vz fp16 meta ([B, Hkv, L/G, D] for axis=channel, [B, Hkv, L, D/G] for token),
  //   lo int32 [1, 2] or [B, 2]: row b sees tokens [lo[b][0], lo[b][1]) (a [1, 2]
  //   span holds for every row). A front count hides a sliding window's expired
  //   tokens still held in their key group; an end below L is a batch row that
  //   holds fewer tokens than the tier's widest row (chunks past it are skipped).
  // outputs: pm, pl [B*Hkv*ROWS, NC] and pacc [B*Hkv*ROWS, NC, D] float32, one
  //   entry per CH-token chunk (NC = ceil(L / CH)): max and sum of 2^score, and
  //   sum of 2^(score - max) v, all relative to the chunk's own max.
  // template: T, D, R, ROWS, BK, GK, KAX, BV, GV, VAX, CH, QSCALE, SMEM
  // Block blockIdx.x walks a run of consecutive chunks with two staging
  // buffers: chunk i+1 streams in (cp.async) while chunk i is scored,
  // softmaxed and accumulated. Each chunk is finished on its own (its own
  // partial), so the value accumulators live only inside one chunk and the
  // query weights can stay in registers.
  constexpr int C = 16;                  // channels per lane
  constexpr int TPT = D / C;             // lanes per token team
  constexpr int NT = D;                  // threads per block
  constexpr int TEAMS = NT / TPT;        // 16 teams
  constexpr int NWARP = NT / 32;
  constexpr int PER = CH / TEAMS;        // tokens per team and chunk
  constexpr int KW = D * BK / 32, VW = D * BV / 32;    // words per token
  constexpr int KLW = C * BK / 32, VLW = C * BV / 32;  // words per lane
  constexpr int KPW = 32 / BK, VPW = 32 / BV;          // codes per word
  constexpr int KM = KAX ? (CH / GK) * D : CH * (D / GK);  // halves per meta array
  constexpr int VM = VAX ? (CH / GV) * D : CH * (D / GV);
  constexpr int O_KC = 0;                 // offsets inside one staging buffer
  constexpr int O_VC = O_KC + CH * KW * 4;
  constexpr int O_KS = O_VC + CH * VW * 4;
  constexpr int O_KZ = O_KS + (KM * 2 + 15) / 16 * 16;
  constexpr int O_VS = O_KZ + (KM * 2 + 15) / 16 * 16;
  constexpr int O_VZ = O_VS + (VM * 2 + 15) / 16 * 16;
  constexpr int STAGE = O_VZ + (VM * 2 + 15) / 16 * 16;
  constexpr int O_Q = 2 * STAGE;           // q rows (log2-scaled)
  constexpr int O_P = O_Q + R * D * 4;     // scores, then probabilities, [token][row]
  constexpr int O_ML = O_P + CH * R * 4;   // chunk max, chunk sum (R <= 4)
  constexpr int O_RED = O_ML + 16 * 4;     // per-warp sums of the value accumulators
  constexpr int NEED = O_RED + NWARP * R * D * 4;
  static_assert(NEED <= SMEM, "shared-memory layout exceeds the launch allocation");
  static_assert(R == 1 || R == 2 || R == 4, "rows per block");
  static_assert(C % KPW == 0 && C % VPW == 0, "a lane holds whole words");
  static_assert(PER % GK == 0 || GK % PER == 0 || !KAX, "team ranges vs key groups");
  static_assert(PER % GV == 0 || GV % PER == 0 || !VAX, "team ranges vs value groups");
  static_assert(CH % GK == 0 || !KAX, "chunks hold whole key groups");
  static_assert(CH % GV == 0 || !VAX, "chunks hold whole value groups");

  extern __shared__ __align__(16) unsigned char vq_smem[];
  const int tid = threadIdx.x;
  const int bh = blockIdx.y, rb = blockIdx.z;
  const int L = kc_shape[2];
  const int NC = (L + CH - 1) / CH;
  const int nsub = (NC + gridDim.x - 1) / gridDim.x;  // chunks per block
  const int cfirst = blockIdx.x * nsub;
  const int cend = min(cfirst + nsub, NC);
  const int span = lo_shape[0] > 1 ? 2 * (bh / kc_shape[1]) : 0;
  const int hide = lo[span];
  const int vend = min(L, lo[span + 1]);
  // Chunks from cstop on hold no visible token: written as empty partials (weight 0 in the reduce).
  const int cstop = max(cfirst, min(cend, (vend + CH - 1) / CH));

  // Stage chunk ci into buffer (ci - cfirst) & 1, as one cp.async group.
  auto stage = [&](int ci) {
    const int t0 = ci * CH;
    const int n = min(CH, L - t0);
    unsigned char* buf = vq_smem + ((ci - cfirst) & 1) * STAGE;
    size_t mo = KAX ? ((size_t)bh * (L / GK) + t0 / GK) * D : ((size_t)bh * L + t0) * (D / GK);
    int mn = KAX ? (n / GK) * D : n * (D / GK);
    vq_stage(buf + O_KC, reinterpret_cast<const unsigned char*>(kc + ((size_t)bh * L + t0) * KW),
             n * KW * 4, tid, NT);
    vq_stage(buf + O_KS, reinterpret_cast<const unsigned char*>(ks + mo), mn * 2, tid, NT);
    vq_stage(buf + O_KZ, reinterpret_cast<const unsigned char*>(kz + mo), mn * 2, tid, NT);
    mo = VAX ? ((size_t)bh * (L / GV) + t0 / GV) * D : ((size_t)bh * L + t0) * (D / GV);
    mn = VAX ? (n / GV) * D : n * (D / GV);
    vq_stage(buf + O_VC, reinterpret_cast<const unsigned char*>(vc + ((size_t)bh * L + t0) * VW),
             n * VW * 4, tid, NT);
    vq_stage(buf + O_VS, reinterpret_cast<const unsigned char*>(vs + mo), mn * 2, tid, NT);
    vq_stage(buf + O_VZ, reinterpret_cast<const unsigned char*>(vz + mo), mn * 2, tid, NT);
    vq_commit();
  };
  if (cfirst < cstop) stage(cfirst);

  // q rows in log2 units (QSCALE = bits of scale * log2(e)): softmax uses exp2.
  float* sq = reinterpret_cast<float*>(vq_smem + O_Q);
  float* sp = reinterpret_cast<float*>(vq_smem + O_P);
  float* sml = reinterpret_cast<float*>(vq_smem + O_ML);
  float* red = reinterpret_cast<float*>(vq_smem + O_RED);
  {
    const float qscale = __int_as_float(QSCALE);
    for (int i = tid; i < R * D; i += NT) {
      const int row = rb * R + i / D;
      sq[i] = row < ROWS ? vq_f(q[((size_t)bh * ROWS + row) * D + i % D]) * qscale : 0.0f;
    }
  }
  const int tm = tid / TPT, li = tid % TPT, c0 = li * C;
  const int warp = tid / 32, lane = tid % 32;

  for (int ci = cfirst; ci < cstop; ++ci) {
    const int n = min(CH, L - ci * CH);
    if (ci + 1 < cstop) stage(ci + 1); else vq_commit();  // empty group: uniform wait arithmetic
    vq_wait<1>();
    __syncthreads();
    const unsigned char* buf = vq_smem + ((ci - cfirst) & 1) * STAGE;

    // 1. Scores. Team tm owns tokens [tm*PER, tm*PER+PER) of the chunk, lane
    // li channels [c0, c0+16). Every lane runs the same trip count (the
    // shuffles need the whole warp); tokens past n read stale shared memory
    // and are dropped.
    {
      const unsigned int* skc = reinterpret_cast<const unsigned int*>(buf + O_KC);
      const __half* sks = reinterpret_cast<const __half*>(buf + O_KS);
      const __half* skz = reinterpret_cast<const __half*>(buf + O_KZ);
      // axis=channel: w2 = q*s*2^B of the current token group, cst = sum(q*z - w2);
      // axis=token:   w2 = q, cst = sum(q) over the lane's channels.
      float w2[R][C];
      float cst[R];
      if constexpr (!KAX) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          cst[r] = 0.0f;
#pragma unroll
          for (int c = 0; c < C; ++c) {
            w2[r][c] = sq[r * D + c0 + c];
            cst[r] += w2[r][c];
          }
        }
      }
#pragma unroll 2
      for (int j = 0; j < PER; ++j) {
        const int t = tm * PER + j;
        if constexpr (KAX) {
          if (j == 0 || t % GK == 0) {  // uniform: team ranges align with groups
            const int g = t / GK;
#pragma unroll
            for (int r = 0; r < R; ++r) cst[r] = 0.0f;
#pragma unroll
            for (int c = 0; c < C; ++c) {
              const float s = __half2float(sks[g * D + c0 + c]) * (float)(1 << BK);
              const float z = __half2float(skz[g * D + c0 + c]);
#pragma unroll
              for (int r = 0; r < R; ++r) {
                const float qv = sq[r * D + c0 + c];
                w2[r][c] = qv * s;
                cst[r] += fmaf(qv, z, -w2[r][c]);
              }
            }
          }
        }
        unsigned int w[KLW];
        vq_load_words<KLW>(w, skc + t * KW + li * KLW);
        float x[C];
#pragma unroll
        for (int c = 0; c < C; ++c) x[c] = vq_code<BK>(w[c / KPW], c % KPW);
        float sc[R];
        if constexpr (KAX) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float a = cst[r];
#pragma unroll
            for (int c = 0; c < C; ++c) a = fmaf(w2[r][c], x[c], a);
            sc[r] = a;
          }
        } else {
          const int jg = c0 / GK;
          const float s = __half2float(sks[t * (D / GK) + jg]) * (float)(1 << BK);
          const float z = __half2float(skz[t * (D / GK) + jg]);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float a = 0.0f;
#pragma unroll
            for (int c = 0; c < C; ++c) a = fmaf(w2[r][c], x[c], a);
            sc[r] = fmaf(s, a - cst[r], z * cst[r]);
          }
        }
        vq_team_reduce<R, TPT>(sc, li);
        if (t < n && li % (TPT / R) == 0) {
          const int at = ci * CH + t;
          sp[t * R + li / (TPT / R)] = at < hide || at >= vend ? vq_ninf() : sc[0];
        }
      }
    }
    __syncthreads();

    // 2. Softmax of the chunk, one warp per row.
    for (int r = warp; r < R; r += NWARP) {
      float m = vq_ninf();
      for (int t = lane; t < n; t += 32) m = fmaxf(m, sp[t * R + r]);
      m = vq_warp_max(m);
      const float mo = m == vq_ninf() ? 0.0f : m;  // a chunk of hidden tokens only: weights 0, not NaN
      float l = 0.0f;
      for (int t = lane; t < n; t += 32) {
        const float p = exp2f(sp[t * R + r] - mo);
        sp[t * R + r] = p;
        l += p;
      }
      l = vq_warp_sum(l);
      if (lane == 0) {
        sml[r] = m;
        sml[R + r] = l;
      }
    }
    __syncthreads();

    // 3. Values: acc[r][c] = sum_t p[r][t] v[t][c0 + c] over the team's tokens.
    float acc[R][C];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < C; ++c) acc[r][c] = 0.0f;
    {
      const unsigned int* svc = reinterpret_cast<const unsigned int*>(buf + O_VC);
      const __half* svs = reinterpret_cast<const __half*>(buf + O_VS);
      const __half* svz = reinterpret_cast<const __half*>(buf + O_VZ);
      if constexpr (!VAX) {
        // p*v = (p*s*2^B) x - p*s*2^B + p*z: one FMA per element and row; the
        // two per-token terms go to cr / zr and are applied once at the end.
        // Teams interleave tokens so a warp reads neighbouring tokens.
        const int jg = c0 / GV;
        float cr[R], zr[R];
#pragma unroll
        for (int r = 0; r < R; ++r) cr[r] = zr[r] = 0.0f;
#pragma unroll 2
        for (int i = 0; i < PER; ++i) {
          const int t = i * TEAMS + tm;
          if (t < n) {
            unsigned int w[VLW];
            vq_load_words<VLW>(w, svc + t * VW + li * VLW);
            float x[C];
#pragma unroll
            for (int c = 0; c < C; ++c) x[c] = vq_code<BV>(w[c / VPW], c % VPW);
            const float s = __half2float(svs[t * (D / GV) + jg]) * (float)(1 << BV);
            const float z = __half2float(svz[t * (D / GV) + jg]);
            float pr[R];
            vq_load_floats<R>(pr, sp + t * R);
#pragma unroll
            for (int r = 0; r < R; ++r) {
              const float ps = pr[r] * s;
              cr[r] += ps;
              zr[r] = fmaf(pr[r], z, zr[r]);
#pragma unroll
              for (int c = 0; c < C; ++c) acc[r][c] = fmaf(ps, x[c], acc[r][c]);
            }
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int c = 0; c < C; ++c) acc[r][c] += zr[r] - cr[r];
      } else {
        // Channel groups: dequantize in registers (v = s2*x + z2) with the
        // group's per-channel constants, reloaded when the token group changes.
        float s2[C], z2[C];
#pragma unroll 2
        for (int j = 0; j < PER; ++j) {
          const int t = tm * PER + j;
          if (j == 0 || t % GV == 0) {
            const int g = t / GV;
#pragma unroll
            for (int c = 0; c < C; ++c) {
              s2[c] = __half2float(svs[g * D + c0 + c]) * (float)(1 << BV);
              z2[c] = __half2float(svz[g * D + c0 + c]) - s2[c];
            }
          }
          if (t < n) {
            unsigned int w[VLW];
            vq_load_words<VLW>(w, svc + t * VW + li * VLW);
            float pr[R];
            vq_load_floats<R>(pr, sp + t * R);
#pragma unroll
            for (int c = 0; c < C; ++c) {
              const float v = fmaf(s2[c], vq_code<BV>(w[c / VPW], c % VPW), z2[c]);
#pragma unroll
              for (int r = 0; r < R; ++r) acc[r][c] = fmaf(pr[r], v, acc[r][c]);
            }
          }
        }
      }
    }

    // 4. Sum the teams: first the 32/TPT teams of a warp by shuffles, then
    // the warps through shared memory; write the chunk's partial.
#pragma unroll
    for (int off = TPT; off < 32; off *= 2)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < C; ++c) acc[r][c] += __shfl_xor_sync(0xffffffffu, acc[r][c], off);
    if (lane < TPT) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < C; c += 4)
          *reinterpret_cast<float4*>(red + (warp * R + r) * D + c0 + c) =
              make_float4(acc[r][c], acc[r][c + 1], acc[r][c + 2], acc[r][c + 3]);
    }
    __syncthreads();
    for (int e = tid; e < R * D; e += NT) {
      float s = 0.0f;
#pragma unroll
      for (int k = 0; k < NWARP; ++k) s += red[k * R * D + e];
      const int row = rb * R + e / D;
      if (row < ROWS) pacc[(((size_t)bh * ROWS + row) * NC + ci) * D + e % D] = s;
    }
    if (tid < R) {
      const int row = rb * R + tid;
      if (row < ROWS) {
        const size_t o = ((size_t)bh * ROWS + row) * NC + ci;
        pm[o] = sml[tid];
        pl[o] = sml[R + tid];
      }
    }
    // No barrier needed here: the next writes of sp / sml / red / this
    // buffer all come after the next iteration's first __syncthreads.
  }
  vq_wait<0>();
  for (int ci = cstop; ci < cend; ++ci) {  // past the row's end: weight 0 in the reduce
    for (int e = tid; e < R * D; e += NT) {
      const int row = rb * R + e / D;
      if (row < ROWS) pacc[(((size_t)bh * ROWS + row) * NC + ci) * D + e % D] = 0.0f;
    }
    if (tid < R && rb * R + tid < ROWS) {
      const size_t o = ((size_t)bh * ROWS + rb * R + tid) * NC + ci;
      pm[o] = vq_ninf();
      pl[o] = 0.0f;
    }
  }

//@@ reduce
  // inputs: pm, pl [NROWS, NS], pacc [NROWS, NS, D]; outputs: out [NROWS, D], lse [NROWS]
  // template: D. Block (128 threads) = one row x 32 channels; warp w takes splits w, w+4, ...
  const int NS = pm_shape[1];
  const int row = blockIdx.y, dc = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* m = pm + (size_t)row * NS;
  const float* l = pl + (size_t)row * NS;
  float M = vq_ninf();
  for (int s = lane; s < NS; s += 32) M = fmaxf(M, m[s]);
  M = vq_warp_max(M);
  if (M == vq_ninf()) M = 0.0f;  // a batch row holding no token here: weights 0, lse -inf, out 0
  float Ls = 0.0f;
  for (int s = lane; s < NS; s += 32) Ls += l[s] * exp2f(m[s] - M);
  Ls = vq_warp_sum(Ls);
  const int d = dc * 32 + lane;
  float a = 0.0f;
  for (int s = warp; s < NS; s += 4) a += pacc[((size_t)row * NS + s) * D + d] * exp2f(m[s] - M);
  __shared__ float part[4][32];
  part[warp][lane] = a;
  __syncthreads();
  if (warp == 0) {
    const float sum = part[0][lane] + part[1][lane] + part[2][lane] + part[3][lane];
    out[(size_t)row * D + d] = Ls > 0.0f ? sum / Ls : 0.0f;
    // natural-log lse of the row's scores: (max + log2(sum)) * ln 2
    if (dc == 0 && lane == 0) lse[row] = (M + log2f(Ls)) * 0.69314718055994531f;
  }

//@@ reduce_tail
  // reduce, plus the exact softmax over up to 2 dense 16-bit tiers (a decode
  // window, sinks) read in place, writing the final output in q's dtype: the
  // window's partial attention and the merge take no launch of their own.
  // inputs: pm, pl [NROWS, NS], pacc [NROWS, NS, D]; q [B, Hq, LQ, D]; xk0, xv0,
  // xk1, xv1 [B, Hkv, W, D] (any strides; tier 1 read only when NX == 2).
  // outputs: out [B, Hq, LQ, D] (T), lse [NROWS] (f32). Every tail token is
  // visible to every query (the caller checks: no mask).
  // template: T, TX, D, NX, REP, LQ, QSCALE, XMAX
  const int NS = pm_shape[1];
  const int row = blockIdx.y, dc = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hkv_n = xk0_shape[1];
  const int per_b = REP * hkv_n * LQ;
  const int b = row / per_b, h = (row % per_b) / LQ, lq = row % LQ, kvh = h / REP;
  const int W0 = xk0_shape[2], W = W0 + (NX > 1 ? xk1_shape[2] : 0);
  __shared__ float qs[D];
  __shared__ float sc[XMAX];
  __shared__ float part[4][32];
  const float qscale = __int_as_float(QSCALE);
  for (int i = threadIdx.x; i < D; i += 128)
    qs[i] = vq_f(q[b * q_strides[0] + h * q_strides[1] + lq * q_strides[2] + i * q_strides[3]]) * qscale;
  __syncthreads();
  // Tail scores (log2 units), one token per warp at a time, lanes over channels.
  for (int t = warp; t < W; t += 4) {
    const bool first = t < W0;
    const TX* k = first ? xk0 + b * xk0_strides[0] + kvh * xk0_strides[1] + t * xk0_strides[2]
                        : xk1 + b * xk1_strides[0] + kvh * xk1_strides[1] + (t - W0) * xk1_strides[2];
    const long long ks = first ? xk0_strides[3] : xk1_strides[3];
    float dot = 0.0f;
    for (int d = lane; d < D; d += 32) dot += qs[d] * vq_f(k[d * ks]);
    dot = vq_warp_sum(dot);
    if (lane == 0) sc[t] = dot;
  }
  __syncthreads();
  const float* m = pm + (size_t)row * NS;
  const float* l = pl + (size_t)row * NS;
  float M = vq_ninf();
  for (int s = lane; s < NS; s += 32) M = fmaxf(M, m[s]);
  for (int t = lane; t < W; t += 32) M = fmaxf(M, sc[t]);
  M = vq_warp_max(M);
  float Ls = 0.0f;
  for (int s = lane; s < NS; s += 32) Ls += l[s] * exp2f(m[s] - M);
  for (int t = lane; t < W; t += 32) Ls += exp2f(sc[t] - M);
  Ls = vq_warp_sum(Ls);
  const int d = dc * 32 + lane;
  float a = 0.0f;
  for (int s = warp; s < NS; s += 4) a += pacc[((size_t)row * NS + s) * D + d] * exp2f(m[s] - M);
  for (int t = warp; t < W; t += 4) {
    const bool first = t < W0;
    const TX* v = first ? xv0 + b * xv0_strides[0] + kvh * xv0_strides[1] + t * xv0_strides[2]
                        : xv1 + b * xv1_strides[0] + kvh * xv1_strides[1] + (t - W0) * xv1_strides[2];
    a += exp2f(sc[t] - M) * vq_f(v[d * (first ? xv0_strides[3] : xv1_strides[3])]);
  }
  part[warp][lane] = a;
  __syncthreads();
  if (warp == 0) {
    const float o = (part[0][lane] + part[1][lane] + part[2][lane] + part[3][lane]) / Ls;
    out[(size_t)row * D + d] = static_cast<T>(o);
    if (dc == 0 && lane == 0) lse[row] = (M + log2f(Ls)) * 0.69314718055994531f;
  }

//@@ dequant
  // Affine codes -> values in T (prefill attends over whole tiers through SDPA):
  // one thread per packed word, no float32 copy of the tier in memory.
  // inputs: codes [B, H, L, W], scales, zeros (token axis: [B, H, L, D/G];
  // channel axis: [B, H, L/G, D]), at = int32 [LO, OFF]; output: out
  // [B, H, LO, D] (T), the tier's tokens at [OFF, OFF + L): the caller writes
  // the layer's other tiers around them (no concatenated copy).
  // (code * scale) + zero in float32, rounded like the MLX ops decode (no FMA).
  // template: T, BITS, G, AX (1 = channel), D
  constexpr int W = D * BITS / 32, PER = 32 / BITS;
  const int L = codes_shape[2];
  const long long n = (long long)codes_shape[0] * codes_shape[1] * L;
  const long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (w >= n * W) return;
  const long long r = w / W;
  const int j = (int)(w % W);
  const unsigned int word = codes[w];
  T* o = out + ((r / L) * at[0] + at[1] + r % L) * D + j * PER;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int d = j * PER + i;
    const long long m = AX ? ((r / L) * (L / G) + (r % L) / G) * D + d : r * (D / G) + d / G;
    const float c = (float)((word >> (i * BITS)) & ((1u << BITS) - 1u));
    o[i] = static_cast<T>(__fadd_rn(__fmul_rn(c, vq_f(scales[m])), vq_f(zeros[m])));
  }

//@@ mma_header
// Helpers of the tensor-core kernel (attend_mma). fp16 pairs travel as
// unsigned ints; a pair's low half is its first element.
union vq_pun { unsigned int u; __half2 h; };
__device__ __forceinline__ __half2 vq_h2(unsigned int v) { vq_pun p; p.u = v; return p.h; }
__device__ __forceinline__ unsigned int vq_u(__half2 h) { vq_pun p; p.h = h; return p.u; }
__device__ __forceinline__ float vq_g(float x) { return x; }
__device__ __forceinline__ float vq_g(__half x) { return __half2float(x); }
__device__ __forceinline__ float vq_g(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float vq_minf() { return __int_as_float(0xff800000); }
template <class X> struct vq_is_f32 { static constexpr bool value = false; };
template <> struct vq_is_f32<float> { static constexpr bool value = true; };

// (a & m) | c in one lop3: written out, as nvcc emits and + or and ptxas
// kept them apart (two LOP3 per widened pair in attend_tc's SASS, ncu).
__device__ __forceinline__ unsigned int vq_and_or(unsigned int a, unsigned int m, unsigned int c) {
  unsigned int r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(a), "r"(m), "r"(c));
  return r;
}

// 2^x for softmax weights: one MUFU.EX2 (exp2f adds a denormal rescale
// around it); results below 2^-126 flush to zero, which a weight may.
__device__ __forceinline__ float vq_ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

// Position p of both 16-bit halves of x (codes of B bits, little-endian) as
// an exact fp16 pair: the code goes into a 1024.0 mantissa (one lop3 or
// prmt), one hfma2/hsub2 removes the offset (and the 2^k of its position).
template <int B>
__device__ __forceinline__ unsigned int vq_pair(unsigned int x, int p) {
  if constexpr (B == 8) {
    const unsigned int v = __byte_perm(x, 0x64646464u, p ? 0x4341 : 0x4240);
    return vq_u(__hsub2(vq_h2(v), vq_h2(0x64006400u)));
  } else {
    constexpr int PPS = 8 / B;
    const int sh = (p / PPS) * 8, k = p % PPS;
    unsigned int m = ((1u << B) - 1u) << (k * B);
    m |= m << 16;
    const unsigned int v = vq_and_or(x >> sh, m, 0x64006400u);
    // 2^-(kB) and -1024 * 2^-(kB) as fp16 bit patterns (exact constants).
    const unsigned int e1 = (unsigned int)(15 - k * B) << 10;
    const unsigned int e2 = 0x8000u | ((unsigned int)(25 - k * B) << 10);
    return vq_u(__hfma2(vq_h2(v), vq_h2(e1 | (e1 << 16)), vq_h2(e2 | (e2 << 16))));
  }
}

// NB bytes (2..64) from p into words (p aligned to min(NB, 16)).
template <int NB>
__device__ __forceinline__ void vq_ld(unsigned int* w, const unsigned char* p) {
  if constexpr (NB == 2) {
    w[0] = *reinterpret_cast<const unsigned short*>(p);
  } else if constexpr (NB == 4) {
    w[0] = *reinterpret_cast<const unsigned int*>(p);
  } else if constexpr (NB == 8) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    w[0] = u.x; w[1] = u.y;
  } else {
#pragma unroll
    for (int k = 0; k < NB / 16; ++k) {
      const uint4 u = reinterpret_cast<const uint4*>(p)[k];
      w[4 * k] = u.x; w[4 * k + 1] = u.y; w[4 * k + 2] = u.z; w[4 * k + 3] = u.w;
    }
  }
}

__device__ __forceinline__ void vq_mma(float (&c)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                                       unsigned int a3, unsigned int b0, unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// fp32 pair -> fp16 pair: the rounded pair (hi) or, with lo = 1, the
// remainder x - hi rounded (together exact to ~2^-22).
__device__ __forceinline__ unsigned int vq_split(float x, float y, float lo) {
  const __half2 h = __floats2half2_rn(x, y);
  const float2 f = __half22float2(h);
  return vq_u(__floats2half2_rn(fmaf(-lo, f.x, x), fmaf(-lo, f.y, y)));
}

//@@ attend_mma
  // Tensor-core variant for per-channel keys / per-token values (KIVI) and at
  // most 4 rows (rep * Lq) per kv head. inputs/outputs as attend, one partial
  // per block: pm, pl [B*Hkv*ROWS, NS], pacc [B*Hkv*ROWS, NS, D].
  // template: T, D, ROWS, BK, GK, BV, GV, QSCALE, NW, PF
  // A warp walks 16-token steps. Scores: mma m16n8k16 with A = key codes
  // (16 tokens x 16 channels, exact in fp16) and B = q*s split into fp16
  // hi/lo columns (8 columns = 4 rows x hi/lo); the channel order inside a
  // lane is free (a dot product), so a lane widens whole code words.
  // Values: A = code*scale split hi/lo (16 channels x 16 tokens, two mmas),
  // B = probabilities split hi/lo; zeros: A = z (groups x tokens), one mma.
  // Online softmax per row with a lazy rescale (only when the max grows by
  // more than 2^8); warps merge through shared memory at the end.
  constexpr int NT = NW * 32;
  constexpr int KNB = D * BK / 32;      // key code bytes of a lane block (D/4 channels)
  constexpr int KWN = KNB / 4;
  constexpr int KPP = 16 / BK;          // pairs per word
  constexpr int KPAIRS = D / 8;         // pairs per lane block
  constexpr int VCH = D / 8;            // value channels per lane block
  constexpr int VNB = VCH * BV / 8;     // their code bytes (2..32)
  constexpr int VWN = VNB >= 4 ? VNB / 4 : 1;
  constexpr int VPW = 32 / BV, VPP = 16 / BV;
  constexpr int NGV = D / GV;           // value groups per token (<= 16)
  constexpr int VT = D / 16;            // value m-tiles
  static_assert(ROWS >= 1 && ROWS <= 4, "rows");
  static_assert(GK % 16 == 0 && GV >= 16 && NGV <= 16, "groups");
  static_assert(KWN >= 1, "key block");

  __shared__ __align__(16) float s_q[4 * D];                   // q rows, fp32
  __shared__ __align__(16) unsigned int s_qh[4 * 4 * KPAIRS];  // [head][tig][pair] fp16 hi pairs
  __shared__ __align__(16) unsigned int s_ql[4 * 4 * KPAIRS];  // fp16 lo pairs (float q)
  __shared__ __align__(16) float s_acc[NW * 4 * D];
  __shared__ float s_z[NW * 4 * 16];
  __shared__ float s_m[NW * 4], s_l[NW * 4];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tig = lane % 4;
  const int bh = blockIdx.y;
  const int L = kc_shape[2];
  const int NS = gridDim.x;
  const int nstep = L / 16;
  const int spb = (nstep + NS - 1) / NS;
  const int b0 = blockIdx.x * spb, b1 = min(b0 + spb, nstep);
  const int spw = (b1 - b0 + NW - 1) / NW;
  const int s0 = min(b0 + warp * spw, b1), s1 = min(s0 + spw, b1);

  for (int i = tid; i < 4 * D; i += NT) {
    const int r = i / D;
    s_q[i] = r < ROWS ? vq_g(q[((size_t)bh * ROWS + r) * D + i % D]) : 0.0f;
  }
  __syncthreads();
  // q pairs in the lanes' channel order: lane block tig = channels
  // [tig*D/4, +D/4); pair P = word P/KPP, position P%KPP: channels
  // (w*2*KPP + p, w*2*KPP + p + KPP).
  for (int i = tid; i < 4 * 4 * KPAIRS; i += NT) {
    const int h = i / (4 * KPAIRS), t4 = (i / KPAIRS) % 4, P = i % KPAIRS;
    const int ca = t4 * (D / 4) + (P / KPP) * 2 * KPP + P % KPP;
    const float xa = s_q[h * D + ca], xb = s_q[h * D + ca + KPP];
    const __half2 hi = __floats2half2_rn(xa, xb);
    const float2 f = __half22float2(hi);
    s_qh[i] = vq_u(hi);
    s_ql[i] = vq_u(__floats2half2_rn(xa - f.x, xb - f.y));
  }
  __syncthreads();

  const float qsc = __int_as_float(QSCALE);
  const bool lo = g & 1;
  const float lof = lo ? 1.0f : 0.0f;
  const unsigned int lomask = lo ? 0xffffffffu : 0u;

  const unsigned char* kcb = reinterpret_cast<const unsigned char*>(kc) + (size_t)bh * L * (D * BK / 8);
  const unsigned char* vcb = reinterpret_cast<const unsigned char*>(vc) + (size_t)bh * L * (D * BV / 8);
  const __half* vsb = reinterpret_cast<const __half*>(vs) + (size_t)bh * L * NGV;
  const __half* vzb = reinterpret_cast<const __half*>(vz) + (size_t)bh * L * NGV;

  float acc[VT][4];
#pragma unroll
  for (int i = 0; i < VT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float cz[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float mrun = vq_minf(), lsum = 0.0f, bias = 0.0f;
  unsigned int qp[KPAIRS];
  int grp = -1;

  unsigned int kw[2][KWN], vw[4][VWN];
  unsigned int kwn[2][KWN], vwn[4][VWN];  // next step's codes (PF); unused and dropped otherwise
  auto load_codes = [&](int st, unsigned int (&k_)[2][KWN], unsigned int (&v_)[4][VWN]) {
    const int T0 = st * 16;
#pragma unroll
    for (int e = 0; e < 2; ++e)
      vq_ld<KNB>(k_[e], kcb + (size_t)(T0 + g + 8 * e) * (D * BK / 8) + tig * KNB);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      vq_ld<VNB>(v_[e], vcb + (size_t)(T0 + 2 * tig + (e & 1) + 8 * (e >> 1)) * (D * BV / 8) + g * VNB);
  };
  if constexpr (PF) {
    if (s0 < s1) load_codes(s0, kwn, vwn);
  }

  for (int st = s0; st < s1; ++st) {
    const int T0 = st * 16;
    if constexpr (PF) {
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int k = 0; k < KWN; ++k) kw[e][k] = kwn[e][k];
#pragma unroll
      for (int e = 0; e < 4; ++e)
#pragma unroll
        for (int k = 0; k < VWN; ++k) vw[e][k] = vwn[e][k];
      if (st + 1 < s1) load_codes(st + 1, kwn, vwn);
    } else {
      load_codes(st, kw, vw);
    }
    // Value metadata of this lane's tokens: ta, tb = T0+2tig+{0,1}; tc, td = +8.
    unsigned int zz[4];  // (z[ta][g], z[tb][g]), (z[ta][g+8], ..), (z[tc][g], z[td][g]), (z[tc][g+8], ..)
    {
      unsigned short zr[4][2];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const size_t t = (size_t)(T0 + 2 * tig + (e & 1) + 8 * (e >> 1));
        zr[e][0] = g < NGV ? *reinterpret_cast<const unsigned short*>(vzb + t * NGV + g) : 0;
        zr[e][1] = g + 8 < NGV ? *reinterpret_cast<const unsigned short*>(vzb + t * NGV + g + 8) : 0;
      }
      zz[0] = zr[0][0] | ((unsigned int)zr[1][0] << 16);
      zz[1] = zr[0][1] | ((unsigned int)zr[1][1] << 16);
      zz[2] = zr[2][0] | ((unsigned int)zr[3][0] << 16);
      zz[3] = zr[2][1] | ((unsigned int)zr[3][1] << 16);
    }

    // Key group change: rebuild the q*s columns and the q.z bias.
    if (T0 / GK != grp) {
      grp = T0 / GK;
      const __half* ksr = reinterpret_cast<const __half*>(ks) + ((size_t)bh * (L / GK) + grp) * D;
      const __half* kzr = reinterpret_cast<const __half*>(kz) + ((size_t)bh * (L / GK) + grp) * D;
      unsigned int sr[D / 8];
      vq_ld<D / 2>(sr, reinterpret_cast<const unsigned char*>(ksr + tig * (D / 4)));
      const unsigned int* qh = s_qh + ((g / 2) * 4 + tig) * KPAIRS;
      const unsigned int* ql = s_ql + ((g / 2) * 4 + tig) * KPAIRS;
#pragma unroll
      for (int P = 0; P < KPAIRS; ++P) {
        const int ia = (P / KPP) * 2 * KPP + P % KPP, ib = ia + KPP;
        const unsigned int s2u =
            __byte_perm(sr[ia / 2], sr[ib / 2], ((ia & 1) ? 0x32 : 0x10) | (((ib & 1) ? 0x76 : 0x54) << 8));
        const __half2 s2 = vq_h2(s2u);
        const __half2 qh2 = vq_h2(qh[P]);
        const unsigned int t = vq_u(__hmul2(qh2, s2));
        unsigned int r = vq_u(__hfma2(qh2, s2, vq_h2((t ^ 0x80008000u) & lomask)));
        if constexpr (vq_is_f32<T>::value) r = vq_u(__hfma2(vq_h2(ql[P] & lomask), s2, vq_h2(r)));
        qp[P] = r;
      }
      // bias of row g/2: this lane takes half of its block's channels.
      unsigned int zr[D / 16];
      const int cb = tig * (D / 4) + (g & 1) * (D / 8);
      vq_ld<D / 4>(zr, reinterpret_cast<const unsigned char*>(kzr + cb));
      float b = 0.0f;
      const float* qrow = s_q + (g / 2) * D + cb;
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        const float2 z2 = __half22float2(vq_h2(zr[k]));
        b = fmaf(qrow[2 * k], z2.x, b);
        b = fmaf(qrow[2 * k + 1], z2.y, b);
      }
      b += __shfl_xor_sync(0xffffffffu, b, 4);
      b += __shfl_xor_sync(0xffffffffu, b, 1);
      b += __shfl_xor_sync(0xffffffffu, b, 2);
      bias = __shfl_sync(0xffffffffu, b, 8 * tig);  // row tig
    }

    // Scores S[token][row hi/lo] for tokens g, g+8 of the step.
    float sc4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int ks_ = 0; ks_ < D / 16; ++ks_) {
      const int Pa = 2 * ks_, Pb = 2 * ks_ + 1;
      vq_mma(sc4, vq_pair<BK>(kw[0][Pa / KPP], Pa % KPP), vq_pair<BK>(kw[1][Pa / KPP], Pa % KPP),
             vq_pair<BK>(kw[0][Pb / KPP], Pb % KPP), vq_pair<BK>(kw[1][Pb / KPP], Pb % KPP), qp[Pa], qp[Pb]);
    }
    const float x0 = (sc4[0] + sc4[1] + bias) * qsc;  // token g, row tig (log2 units)
    const float x1 = (sc4[2] + sc4[3] + bias) * qsc;  // token g + 8
    float tmax = fmaxf(x0, x1);
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 4));
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 8));
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 16));
    const bool need = tmax > mrun + 8.0f;
    if (__any_sync(0xffffffffu, need)) {
      const float mnew = need ? tmax : mrun;
      const float f = exp2f(mrun - mnew);
      mrun = mnew;
      lsum *= f;
#pragma unroll
      for (int i = 0; i < VT; ++i) {
        acc[i][0] *= f; acc[i][1] *= f; acc[i][2] *= f; acc[i][3] *= f;
      }
      cz[0] *= f; cz[1] *= f; cz[2] *= f; cz[3] *= f;
    }
    const float p0 = exp2f(x0 - mrun), p1 = exp2f(x1 - mrun);
    lsum += p0 + p1;
    // Probabilities of row g/2 at tokens 2tig, 2tig+1 (held by lanes 8tig + g/2
    // and 8tig + 4 + g/2 as their token g') and 2tig+8, 2tig+9 (their g'+8).
    const int sa = 8 * tig + g / 2;
    const float pa = __shfl_sync(0xffffffffu, p0, sa), pb = __shfl_sync(0xffffffffu, p0, sa + 4);
    const float pc = __shfl_sync(0xffffffffu, p1, sa), pd = __shfl_sync(0xffffffffu, p1, sa + 4);
    const unsigned int pb0 = vq_split(pa, pb, lof), pb1 = vq_split(pc, pd, lof);

    // Values. Lane block g = channels g*VCH + [0, VCH); tile i rows g / g+8 =
    // channels 2i / 2i+1 of the block. Pairs are (token a, token b).
    unsigned int xlo[2][VWN], xhi[2][VWN];
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int k = 0; k < VWN; ++k) {
        xlo[e][k] = __byte_perm(vw[2 * e][k], vw[2 * e + 1][k], 0x5410);
        xhi[e][k] = __byte_perm(vw[2 * e][k], vw[2 * e + 1][k], 0x7632);
      }
    constexpr int NGT = VCH > GV ? VCH / GV : 1;
    __half2 sv[2][NGT];
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int u = 0; u < NGT; ++u) {
        const int j = (g * VCH) / GV + u;
        const size_t ta = (size_t)(T0 + 2 * tig + 8 * e);
        const unsigned int sa_ = *reinterpret_cast<const unsigned short*>(vsb + ta * NGV + j);
        const unsigned int sb_ = *reinterpret_cast<const unsigned short*>(vsb + (ta + 1) * NGV + j);
        sv[e][u] = vq_h2(sa_ | (sb_ << 16));
      }
#pragma unroll
    for (int i = 0; i < VT; ++i) {
      unsigned int ah[4], al[4];  // (ch 2i, tok ab), (ch 2i+1, tok ab), (ch 2i, tok cd), (ch 2i+1, tok cd)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int c = 2 * i + (r & 1), e = r >> 1;
        const int w = c / VPW, qq = c % VPW;
        const unsigned int x = (qq / VPP) ? xhi[e][w] : xlo[e][w];
        const __half2 c2 = vq_h2(vq_pair<BV>(x, qq % VPP));
        const __half2 s2 = sv[e][NGT > 1 ? c / GV : 0];
        const __half2 h = __hmul2(c2, s2);
        ah[r] = vq_u(h);
        al[r] = vq_u(__hfma2(c2, s2, __hneg2(h)));
      }
      vq_mma(acc[i], ah[0], ah[1], ah[2], ah[3], pb0, pb1);
      vq_mma(acc[i], al[0], al[1], al[2], al[3], pb0, pb1);
    }
    vq_mma(cz, zz[0], zz[1], zz[2], zz[3], pb0, pb1);
  }

  // Warp partials -> shared memory (row tig, hi + lo columns).
  {
    float* wa = s_acc + (warp * 4 + tig) * D + g * VCH;
#pragma unroll
    for (int i = 0; i < VT; ++i) {
      wa[2 * i] = acc[i][0] + acc[i][1];
      wa[2 * i + 1] = acc[i][2] + acc[i][3];
    }
    float* wz = s_z + (warp * 4 + tig) * 16;
    if (g < NGV) wz[g] = cz[0] + cz[1];
    if (g + 8 < NGV) wz[g + 8] = cz[2] + cz[3];
    float l = lsum;
    l += __shfl_xor_sync(0xffffffffu, l, 4);
    l += __shfl_xor_sync(0xffffffffu, l, 8);
    l += __shfl_xor_sync(0xffffffffu, l, 16);
    if (g == 0) {
      s_m[warp * 4 + tig] = mrun;
      s_l[warp * 4 + tig] = l;
    }
  }
  __syncthreads();
  for (int e = tid; e < ROWS * D; e += NT) {
    const int r = e / D, d = e % D;
    float M = vq_minf();
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, s_m[w * 4 + r]);
    float a = 0.0f, l = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float mw = s_m[w * 4 + r];
      const float f = mw == vq_minf() ? 0.0f : exp2f(mw - M);
      a += f * (s_acc[(w * 4 + r) * D + d] + s_z[(w * 4 + r) * 16 + d / GV]);
      l += f * s_l[w * 4 + r];
    }
    const size_t o = ((size_t)bh * ROWS + r) * NS + blockIdx.x;
    pacc[o * D + d] = a;
    if (d == 0) {
      pm[o] = M;
      pl[o] = l;
    }
  }
