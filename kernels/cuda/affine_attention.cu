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
  //   ks/kz, vs/vz fp16 meta ([B, Hkv, L/G, D] for axis=channel, [B, Hkv, L, D/G] for token)
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
  if (cfirst < cend) stage(cfirst);

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

  for (int ci = cfirst; ci < cend; ++ci) {
    const int n = min(CH, L - ci * CH);
    if (ci + 1 < cend) stage(ci + 1); else vq_commit();  // empty group: uniform wait arithmetic
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
        if (t < n && li % (TPT / R) == 0) sp[t * R + li / (TPT / R)] = sc[0];
      }
    }
    __syncthreads();

    // 2. Softmax of the chunk, one warp per row.
    for (int r = warp; r < R; r += NWARP) {
      float m = vq_ninf();
      for (int t = lane; t < n; t += 32) m = fmaxf(m, sp[t * R + r]);
      m = vq_warp_max(m);
      float l = 0.0f;
      for (int t = lane; t < n; t += 32) {
        const float p = exp2f(sp[t * R + r] - m);
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
    out[(size_t)row * D + d] = (part[0][lane] + part[1][lane] + part[2][lane] + part[3][lane]) / Ls;
    // natural-log lse of the row's scores: (max + log2(sum)) * ln 2
    if (dc == 0 && lane == 0) lse[row] = (M + log2f(Ls)) * 0.69314718055994531f;
  }
