// Dense linear layers with weights resident on the GPU: y[t, r] = W[r, :] . x[t, :] for W [rows, cols] in f32 or bf16
// (raw bits; row-wise int8: below) and x [T, cols] in f32. A warp owns DENSE_RPW rows at once: per step each lane loads
// DENSE_UNROLL 16-byte words of every row (coalesced across the warp, streamed past L1) before it uses any, so enough
// bytes are in flight per SM for the HBM rate at one token, and each activation word it loads (from global memory,
// small and L1-resident) serves all the warp's rows. Tokens go in tiles of DENSE_TT, so a weight row is read once per
// tile. Requires cols % 4 == 0 (f32) or cols % 8 == 0 (bf16); the Rust side keeps other shapes on the CPU.
//
// Split: the `split` warps (1, 2, 4 or 8) of a row group each take one contiguous part of the columns, and the
// parts' sums are added in order through shared memory. A product of few rows then still spreads over enough
// warps to fill every SM for the same number of rounds (without it, a [12288, 7168] product is 1.45 waves of
// blocks and its last wave runs half empty). A row's sum depends on its matrix's split only.

#define DENSE_WARPS 8
#define DENSE_RPW 4
#define DENSE_TT 8
#define DENSE_UNROLL 2

__device__ __forceinline__ float bf16_lo(u32 v) { return __int_as_float((int)(v << 16)); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __int_as_float((int)(v & 0xffff0000u)); }

// The weights of one 16-byte word: 8 bf16 or 4 f32.
template <bool BF16>
__device__ __forceinline__ void dense_widen(uint4 p, float* wv) {
    if (BF16) {
        wv[0] = bf16_lo(p.x); wv[1] = bf16_hi(p.x); wv[2] = bf16_lo(p.y); wv[3] = bf16_hi(p.y);
        wv[4] = bf16_lo(p.z); wv[5] = bf16_hi(p.z); wv[6] = bf16_lo(p.w); wv[7] = bf16_hi(p.w);
    } else {
        wv[0] = __uint_as_float(p.x); wv[1] = __uint_as_float(p.y);
        wv[2] = __uint_as_float(p.z); wv[3] = __uint_as_float(p.w);
    }
}

// The rows of block `block` of one matrix's product, its columns in `split` parts (a divisor of DENSE_WARPS).
// Every thread of the block must call it (it synchronises the block when split > 1).
template <bool BF16>
__device__ void dense_gemm_impl(const void* w, const float* x, float* y, int rows, int cols, int n_tok,
                                int block, int split) {
    constexpr int PER = BF16 ? 8 : 4;  // weights per 16-byte word
    __shared__ float part_sums[DENSE_WARPS][DENSE_RPW][DENSE_TT];
    int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    int group = warp / split, part = warp % split;
    int row0 = (block * (DENSE_WARPS / split) + group) * DENSE_RPW;
    if (split == 1 && row0 >= rows) return;
    int words = cols / PER;
    int chunk = (words + split - 1) / split;
    int w0 = min(part * chunk, words), w1 = min(w0 + chunk, words);
    if (row0 >= rows) w1 = w0;  // a group past the end only joins the barriers
    // Rows past the end read the last row (their sums are not written).
    const uint4* wr[DENSE_RPW];
#pragma unroll
    for (int r = 0; r < DENSE_RPW; r++)
        wr[r] = (const uint4*)w + (size_t)min(row0 + r, rows - 1) * words;
    for (int t0 = 0; t0 < n_tok; t0 += DENSE_TT) {
        int count = min(DENSE_TT, n_tok - t0);
        float acc[DENSE_RPW][DENSE_TT];
#pragma unroll
        for (int r = 0; r < DENSE_RPW; r++)
#pragma unroll
            for (int t = 0; t < DENSE_TT; t++) acc[r][t] = 0.f;
        for (int i0 = w0 + lane; i0 < w1; i0 += WARP * DENSE_UNROLL) {
            uint4 p[DENSE_UNROLL][DENSE_RPW];
#pragma unroll
            for (int u = 0; u < DENSE_UNROLL; u++) {
                int i = i0 + u * WARP;
#pragma unroll
                for (int r = 0; r < DENSE_RPW; r++)
                    p[u][r] = i < w1 ? __ldcs(wr[r] + i) : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < DENSE_UNROLL; u++) {
                int i = i0 + u * WARP;
                if (i >= w1) break;
                float wv[DENSE_RPW][PER];
#pragma unroll
                for (int r = 0; r < DENSE_RPW; r++) dense_widen<BF16>(p[u][r], wv[r]);
#pragma unroll
                for (int t = 0; t < DENSE_TT; t++) {
                    if (t < count) {
                        const float4* xr = (const float4*)(x + (size_t)(t0 + t) * cols) + (PER / 4) * i;
                        float xv[PER];
#pragma unroll
                        for (int q = 0; q < PER / 4; q++) {
                            float4 a = __ldg(xr + q);
                            xv[4 * q] = a.x; xv[4 * q + 1] = a.y; xv[4 * q + 2] = a.z; xv[4 * q + 3] = a.w;
                        }
#pragma unroll
                        for (int r = 0; r < DENSE_RPW; r++) {
                            float s = acc[r][t];
#pragma unroll
                            for (int e = 0; e < PER; e++) s = fmaf(wv[r][e], xv[e], s);
                            acc[r][t] = s;
                        }
                    }
                }
            }
        }
        // Each warp's sums: straight into y when the columns are whole, else into shared memory for the group.
#pragma unroll
        for (int t = 0; t < DENSE_TT; t++) {
            if (t < count) {
#pragma unroll
                for (int r = 0; r < DENSE_RPW; r++) {
                    float v = warp_sum(acc[r][t]);
                    if (lane != 0) continue;
                    if (split > 1) part_sums[warp][r][t] = v;
                    else if (row0 + r < rows) y[(size_t)(t0 + t) * rows + row0 + r] = v;
                }
            }
        }
        if (split == 1) continue;
        __syncthreads();
        // The group's first warp adds its parts in order, a lane per (row, token).
        if (part == 0) {
            for (int k = lane; k < DENSE_RPW * DENSE_TT; k += WARP) {
                int r = k / DENSE_TT, t = k % DENSE_TT;
                float v = 0.f;
                for (int q = 0; q < split; q++) v += part_sums[warp + q][r][t];
                if (t < count && row0 + r < rows) y[(size_t)(t0 + t) * rows + row0 + r] = v;
            }
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(DENSE_WARPS * WARP)
    dense_gemm_f32(const float* w, const float* x, float* y, int rows, int cols, int n_tok, int split) {
    dense_gemm_impl<false>(w, x, y, rows, cols, n_tok, blockIdx.x, split);
}

extern "C" __global__ void __launch_bounds__(DENSE_WARPS * WARP)
    dense_gemm_bf16(const u16* w, const float* x, float* y, int rows, int cols, int n_tok, int split) {
    dense_gemm_impl<true>(w, x, y, rows, cols, n_tok, blockIdx.x, split);
}

// Several matrices of one kind and width that read the same input x, in one launch (passed by value; the layout
// matches `DenseJobs` in crates/quant/src/cuda/dense.rs): matrix j owns blocks first[j] .. first[j + 1] and splits
// its columns in split[j] parts. Each row's sum is the one-matrix kernel's at the same split, so the results are
// the same bits; one launch instead of several saves the launches and the tail of each.
#define DENSE_MAX_JOBS 8
struct DenseJobs {
    const void* w[DENSE_MAX_JOBS];
    float* y[DENSE_MAX_JOBS];
    const float* s[DENSE_MAX_JOBS];  // int8 only: the rows' scales
    int rows[DENSE_MAX_JOBS];
    int split[DENSE_MAX_JOBS];
    int first[DENSE_MAX_JOBS + 1];
    int n;
};

template <bool BF16>
__device__ void dense_gemm_multi_impl(const DenseJobs& jobs, const float* x, int cols, int n_tok) {
    int b = blockIdx.x, j = 0;
    while (j + 1 < jobs.n && b >= jobs.first[j + 1]) j++;
    dense_gemm_impl<BF16>(jobs.w[j], x, jobs.y[j], jobs.rows[j], cols, n_tok, b - jobs.first[j], jobs.split[j]);
}

extern "C" __global__ void __launch_bounds__(DENSE_WARPS * WARP)
    dense_gemm_multi_f32(const DenseJobs jobs, const float* x, int cols, int n_tok) {
    dense_gemm_multi_impl<false>(jobs, x, cols, n_tok);
}

extern "C" __global__ void __launch_bounds__(DENSE_WARPS * WARP)
    dense_gemm_multi_bf16(const DenseJobs jobs, const float* x, int cols, int n_tok) {
    dense_gemm_multi_impl<true>(jobs, x, cols, n_tok);
}

// Row-wise int8 weights (crates/quant/src/int8_contract.rs): w[r, c] = q[r, c] s_w[r]. Each input row is quantised
// once per product to int16 (dense_quantise_i16: s_x = max|x| / 32767, q_x = round(x / s_x), ties away from zero,
// clamped), and a row's result is (sum of q q_x, an exact integer) s_w s_x in f64, rounded once to f32: the CPU's bits
// for every order of the sum, so neither the warps' split nor the token tiles change them. Requires cols % 16 == 0.
#define INT8_Q_MAX 32767.0f

// Whether v is NaN or infinite.
__device__ __forceinline__ bool not_finite(float v) { return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u; }

// One block per input row t: xq[t, :cols] = round(x[t, :] / s_x) and xs[t] = s_x (NaN and all-zero q for a row with
// a non-finite value; 0 and all-zero q for a zero row), as quantise::symmetric on the CPU.
extern "C" __global__ void dense_quantise_i16(const float* x, short* xq, float* xs, int cols) {
    __shared__ float maxes[32];
    __shared__ int bads[32];
    const float* xr = x + (size_t)blockIdx.x * cols;
    short* qr = xq + (size_t)blockIdx.x * cols;
    int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1), warps = blockDim.x / WARP;
    float m = 0.f;
    int bad = 0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = xr[c];
        bad |= not_finite(v);
        m = fmaxf(m, fabsf(v));
    }
    m = warp_max(m);
    bad = __any_sync(FULL_MASK, bad);
    if (lane == 0) {
        maxes[warp] = m;
        bads[warp] = bad;
    }
    __syncthreads();
    if (warp == 0) {
        m = warp_max(lane < warps ? maxes[lane] : 0.f);
        bad = __any_sync(FULL_MASK, lane < warps ? bads[lane] : 0);
        if (lane == 0) {
            maxes[0] = m;
            bads[0] = bad;
        }
    }
    __syncthreads();
    m = maxes[0];
    bool quantise = !bads[0] && m > 0.f;
    float step = m / INT8_Q_MAX;  // IEEE division, as on the CPU
    if (threadIdx.x == 0) xs[blockIdx.x] = bads[0] ? __int_as_float(0x7fc00000) : (quantise ? step : 0.f);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float r = quantise ? fminf(fmaxf(roundf(xr[c] / step), -INT8_Q_MAX), INT8_Q_MAX) : 0.f;
        qr[c] = (short)r;
    }
}

// d = c + a.h0 b.b0 + a.h1 b.b1 (lo) or + a.h0 b.b2 + a.h1 b.b3 (hi): two int16 by two int8, exact.
__device__ __forceinline__ int dp2a_lo(u32 a, u32 b, int c) {
    int d;
    asm("dp2a.lo.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ int dp2a_hi(u32 a, u32 b, int c) {
    int d;
    asm("dp2a.hi.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Sum over the 32 lanes of a warp (exact); every lane gets the result.
__device__ __forceinline__ long long warp_sum_i64(long long v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// dense_gemm_impl for int8 rows: the same rows per block and column parts, tiles of INT8_TT tokens; each 16-byte word
// holds 16 weights, and a token's 16 matching int16 inputs are two 16-byte words of xq. A word adds at most 16 * 128 *
// 32767 to a lane's 32-bit sum, 32 words less than 2^31, so every INT8_FLUSH_STEPS steps (INT8_FLUSH_STEPS *
// DENSE_UNROLL = 32 words a lane) the warp's sums go into 64-bit totals in shared memory (a row of up to 32 words a
// lane, K3's spine but for its widest matrix, never flushes before the end), and no row length overflows.
#define INT8_FLUSH_STEPS 16
// Tokens per tile (half the float kernels' DENSE_TT: a token's inputs take twice the registers of 16 weights).
#define INT8_TT 4

// The warp's exact sums (acc, one a lane) added into its 64-bit totals (lane 0 writes) and cleared.
__device__ __forceinline__ void int8_flush(int (&acc)[DENSE_RPW][INT8_TT], long long (*tot)[INT8_TT], int lane) {
#pragma unroll
    for (int r = 0; r < DENSE_RPW; r++)
#pragma unroll
        for (int t = 0; t < INT8_TT; t++) {
            long long v = warp_sum_i64((long long)acc[r][t]);
            if (lane == 0) tot[r][t] += v;
            acc[r][t] = 0;
        }
}

__device__ void dense_gemm_int8_impl(const void* w, const float* sw, const short* xq, const float* xs, float* y,
                                     int rows, int cols, int n_tok, int block, int split) {
    __shared__ long long totals[DENSE_WARPS][DENSE_RPW][INT8_TT];
    int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    int group = warp / split, part = warp % split;
    int row0 = (block * (DENSE_WARPS / split) + group) * DENSE_RPW;
    if (split == 1 && row0 >= rows) return;
    int words = cols / 16;
    int chunk = (words + split - 1) / split;
    int w0 = min(part * chunk, words), w1 = min(w0 + chunk, words);
    if (row0 >= rows) w1 = w0;  // a group past the end only joins the barriers
    const uint4* wr[DENSE_RPW];
#pragma unroll
    for (int r = 0; r < DENSE_RPW; r++)
        wr[r] = (const uint4*)w + (size_t)min(row0 + r, rows - 1) * words;
    for (int t0 = 0; t0 < n_tok; t0 += INT8_TT) {
        int count = min(INT8_TT, n_tok - t0);
        int acc[DENSE_RPW][INT8_TT];
#pragma unroll
        for (int r = 0; r < DENSE_RPW; r++)
#pragma unroll
            for (int t = 0; t < INT8_TT; t++) {
                acc[r][t] = 0;
                if (lane == 0) totals[warp][r][t] = 0;
            }
        // Steps are the same for every lane of the warp (the flushes shuffle across it); lanes past the part's end
        // load zeros.
        int step = 0;
        for (int base = w0; base < w1; base += WARP * DENSE_UNROLL, step++) {
            if (step == INT8_FLUSH_STEPS) {
                int8_flush(acc, totals[warp], lane);
                step = 0;
            }
            int i0 = base + lane;
            uint4 p[DENSE_UNROLL][DENSE_RPW];
#pragma unroll
            for (int u = 0; u < DENSE_UNROLL; u++) {
                int i = i0 + u * WARP;
#pragma unroll
                for (int r = 0; r < DENSE_RPW; r++)
                    p[u][r] = i < w1 ? __ldcs(wr[r] + i) : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < DENSE_UNROLL; u++) {
                int i = i0 + u * WARP;
                if (i >= w1) break;
#pragma unroll
                for (int t = 0; t < INT8_TT; t++) {
                    if (t < count) {
                        const uint4* xr = (const uint4*)(xq + (size_t)(t0 + t) * cols) + 2 * i;
                        uint4 a = __ldg(xr), b = __ldg(xr + 1);
#pragma unroll
                        for (int r = 0; r < DENSE_RPW; r++) {
                            uint4 q = p[u][r];
                            int s = dp2a_lo(a.x, q.x, acc[r][t]);
                            s = dp2a_hi(a.y, q.x, s);
                            s = dp2a_lo(a.z, q.y, s);
                            s = dp2a_hi(a.w, q.y, s);
                            s = dp2a_lo(b.x, q.z, s);
                            s = dp2a_hi(b.y, q.z, s);
                            s = dp2a_lo(b.z, q.w, s);
                            acc[r][t] = dp2a_hi(b.w, q.w, s);
                        }
                    }
                }
            }
        }
        int8_flush(acc, totals[warp], lane);
        // A row's exact sum times its scale and the token's, in f64 (int8_contract's `finish`): a group's parts are
        // added in shared memory first when the columns are split.
        if (split > 1) __syncthreads();
        else __syncwarp();
        if (part == 0 && lane < DENSE_RPW * INT8_TT) {
            int r = lane / INT8_TT, t = lane % INT8_TT;
            long long v = 0;
            for (int q = 0; q < split; q++) v += totals[warp + q][r][t];
            if (t < count && row0 + r < rows)
                y[(size_t)(t0 + t) * rows + row0 + r] = (float)((double)v * (double)sw[row0 + r] * (double)xs[t0 + t]);
        }
        // Before the next tile clears the totals (a warp reads only its own when the columns are whole).
        if (split > 1) __syncthreads();
        else __syncwarp();
    }
}

extern "C" __global__ void __launch_bounds__(DENSE_WARPS * WARP, 2)
    dense_gemm_int8(const signed char* w, const float* sw, const short* xq, const float* xs, float* y, int rows,
                    int cols, int n_tok, int split) {
    dense_gemm_int8_impl(w, sw, xq, xs, y, rows, cols, n_tok, blockIdx.x, split);
}

extern "C" __global__ void __launch_bounds__(DENSE_WARPS * WARP, 2)
    dense_gemm_multi_int8(const DenseJobs jobs, const short* xq, const float* xs, int cols, int n_tok) {
    int b = blockIdx.x, j = 0;
    while (j + 1 < jobs.n && b >= jobs.first[j + 1]) j++;
    dense_gemm_int8_impl(jobs.w[j], jobs.s[j], xq, xs, jobs.y[j], jobs.rows[j], cols, n_tok, b - jobs.first[j],
                         jobs.split[j]);
}

// Plain device-to-device copy of n 16-byte words (the bandwidth reference measured in the same run as the MoE
// kernels).
extern "C" __global__ void copy16(const uint4* src, uint4* dst, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}

// Copies n floats from src to dst, either of which may be page-locked host memory addressed through unified
// addressing: a layer's activation rows go up and down by a kernel on the compute stream, without a round trip through
// a copy engine (a 28 KB row took 9-19 µs that way on the H200).
extern "C" __global__ void copy_f32(const float* src, float* dst, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}
