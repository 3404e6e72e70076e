// Attention on the GPU: KDA (its inputs, the delta-rule recurrence, the gated norm) and absorbed NoPE MLA over the
// latent cache.

// log(1 + e^x), linear above 20 (the CPU's `ops::softplus`).
__device__ __forceinline__ float softplusf_(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Sum over the threads of one part of a block laid out as (blockDim.x = a multiple of 32, at most 1024; parts
// along y, one part for a 1-D block): every thread of the part gets the sum. `scratch` is 32 floats of shared
// memory per part, free again when the call returns; every thread of the block must call it (it synchronises the
// block).
__device__ float part_sum(float v, float* scratch) {
    int lane = threadIdx.x & (WARP - 1), w = threadIdx.x / WARP, nw = blockDim.x / WARP;
    float* mine = scratch + threadIdx.y * WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) mine[w] = v;
    __syncthreads();
    float s = 0.f;
    for (int i = 0; i < nw; i++) s += mine[i];
    __syncthreads();
    return s;
}

// Copies n floats from src to dst with the block's `nthreads` threads (this one is `tid`), 16 bytes at a time when
// n is a multiple of 4 (both pointers then 16-byte aligned, as a head's block of a KDA state is).
__device__ __forceinline__ void block_copy(float* dst, const float* src, int n, int tid, int nthreads) {
    if ((n & 3) == 0) {
        for (int i = tid; i < n / 4; i += nthreads) ((float4*)dst)[i] = ((const float4*)src)[i];
    } else {
        for (int i = tid; i < n; i += nthreads) dst[i] = src[i];
    }
}

// SiLU of the short causal conv of channel `ch` at token t, for the three inputs i = q, k, v: over (old window ++
// raw rows), taps oldest first, each sum in tap order. With four taps (K3, Kimi Linear) every operand is loaded
// before any is summed, so the loads wait on memory together rather than one after another.
__device__ __forceinline__ void kda_conv3(const float* win, const float* const raws[3], const float* taps, int t,
                                          int ch, int c, int kern, float vals[3]) {
    const int hist = kern - 1;
    if (kern == 4) {
        float x[3][4], tp[3][4];
#pragma unroll
        for (int i = 0; i < 3; i++)
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                int r = t + kk;
                x[i][kk] = r < 3 ? win[((size_t)i * 3 + r) * c + ch] : raws[i][(size_t)(r - 3) * c + ch];
                tp[i][kk] = taps[((size_t)i * c + ch) * 4 + kk];
            }
#pragma unroll
        for (int i = 0; i < 3; i++) {
            float acc = 0.f;
#pragma unroll
            for (int kk = 0; kk < 4; kk++) acc += tp[i][kk] * x[i][kk];
            vals[i] = acc * sigmoidf_(acc);
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < 3; i++) {
        const float* w = win + (size_t)i * hist * c;
        const float* tp = taps + ((size_t)i * c + ch) * kern;
        float acc = 0.f;
        for (int kk = 0; kk < kern; kk++) {
            int r = t + kk;
            float x = r < hist ? w[(size_t)r * c + ch] : raws[i][(size_t)(r - hist) * c + ch];
            acc += tp[kk] * x;
        }
        vals[i] = acc * sigmoidf_(acc);
    }
}

// z += (eight bf16 weights w) . (x0, x1), in index order.
__device__ __forceinline__ float bf16x8_fma(uint4 w, float4 x0, float4 x1, float z) {
    z = fmaf(__int_as_float((int)(w.x << 16)), x0.x, z);
    z = fmaf(__int_as_float((int)(w.x & 0xffff0000u)), x0.y, z);
    z = fmaf(__int_as_float((int)(w.y << 16)), x0.z, z);
    z = fmaf(__int_as_float((int)(w.y & 0xffff0000u)), x0.w, z);
    z = fmaf(__int_as_float((int)(w.z << 16)), x1.x, z);
    z = fmaf(__int_as_float((int)(w.z & 0xffff0000u)), x1.y, z);
    z = fmaf(__int_as_float((int)(w.w << 16)), x1.z, z);
    return fmaf(__int_as_float((int)(w.w & 0xffff0000u)), x1.w, z);
}

// z += (four f32 weights w) . x, in index order.
__device__ __forceinline__ float f32x4_fma(float4 w, float4 x, float z) {
    z = fmaf(w.x, x.x, z);
    z = fmaf(w.y, x.y, z);
    z = fmaf(w.z, x.z, z);
    return fmaf(w.w, x.w, z);
}

// The decay gate of channel `ch` at the token whose f_a row is `fa_row` ([R], 16-byte aligned): z = f_b[ch] . f_a
// (index order) + bias, then K3's bounded form `lower_bound * sigma(a z)` when `bounded`, else Kimi Linear's
// `-a softplus(z)`. f_b is [C, R] of bf16 bits or f32, whole 16-byte words a row; B of its words are loaded before
// any is summed.
template <int B>
__device__ __forceinline__ float kda_gate(const float* fa_row, const void* f_b, int f_b_bf16, int rank, int ch,
                                          float bias, float a, int bounded, float lower_bound) {
    const float4* fa = (const float4*)fa_row;
    float z = 0.f;
    if (f_b_bf16) {
        const uint4* row = (const uint4*)((const u16*)f_b + (size_t)ch * rank);
        const int n = rank / 8;
        int i = 0;
        for (; i + B <= n; i += B) {
            uint4 w[B];
#pragma unroll
            for (int u = 0; u < B; u++) w[u] = row[i + u];
#pragma unroll
            for (int u = 0; u < B; u++) z = bf16x8_fma(w[u], fa[2 * (i + u)], fa[2 * (i + u) + 1], z);
        }
        for (; i < n; i++) z = bf16x8_fma(row[i], fa[2 * i], fa[2 * i + 1], z);
    } else {
        const float4* row = (const float4*)((const float*)f_b + (size_t)ch * rank);
        const int n = rank / 4;
        int i = 0;
        for (; i + B <= n; i += B) {
            float4 w[B];
#pragma unroll
            for (int u = 0; u < B; u++) w[u] = row[i + u];
#pragma unroll
            for (int u = 0; u < B; u++) z = f32x4_fma(w[u], fa[i + u], z);
        }
        for (; i < n; i++) z = f32x4_fma(row[i], fa[i], z);
    }
    z += bias;
    return bounded ? lower_bound * sigmoidf_(a * z) : -a * softplusf_(z);
}

// One KDA layer after its input products, one block per head h = blockIdx.x, in one launch. Thread (j, p) =
// (threadIdx.x, threadIdx.y): channel j of the head (blockDim.x = d rounded up to a warp), part p of KDA_PARTS.
//
// 1. Inputs (the CPU's `Kda::head_inputs`, up to summation order), tokens t = p, p + KDA_PARTS, ... in parallel:
//    q, k, v = SiLU of the short causal conv over (old window ++ raw rows); q and k L2-normalised over the head (q
//    also scaled by d^-1/2); the decay gate from z = f_b . f_a + dt_bias (f_b . f_a is the low-rank product's second
//    half, a row of f_b per channel, bf16 bits or f32), K3's bounded form `lower_bound * sigma(a z)` when
//    `bounded`, else Kimi Linear's `-a softplus(z)`; beta = sigma(b_raw). Token 0's threads also write the next
//    windows: the last K-1 rows of (old window ++ raw).
// 2. The recurrence, the head's state S [D_k, D_v] in shared memory. Per token:
//      S <- diag(exp g) S;  u = S^T k;  delta = beta (v - u);  S <- S + k delta^T;  o = S^T q.
//    Thread (j, p) owns value column j for the key rows p, p + KDA_PARTS, ...; the sums over keys are reduced
//    across the parts through shared memory.
// 3. The gated RMSNorm of each token's output row over the head (the CPU's `Kda::gated_norm_row`), in place:
//    o <- (o * inv_rms(o)) * w * sigma(gate).
// raw_*: [T, C]; win, new_win: [3, K-1, C] (q, k, v); taps: [3, C, K] (oldest tap first); f_a: [T, R]; f_b: [C, R]
// (R % 8 == 0 for bf16, % 4 for f32: whole 16-byte words); gate: [T, C]; dt_bias: [C]; a_exp: [H]; b_raw, beta:
// [T, H]; norm_w: [d]; q, k, v, g, out: [T, C] (q, k, v, g scratch written in step 1 and read in step 2);
// state_in, state_out: [H, D, D] (the old matrices and the new ones; they may be the same buffer: a head's old
// block is read whole before its new one is written).
#define KDA_L2_EPS 1e-6f
// f_b words a thread loads at once in the gate's dot (`kda_gate`): a 1024-thread block leaves a thread 64 registers.
#define KDA_GATE_WORDS 2
#define KDA_PARTS 4
extern "C" __global__ void __launch_bounds__(1024)
    kda_layer(const float* raw_q, const float* raw_k, const float* raw_v, const float* win, const float* taps,
              const float* f_a, const void* f_b, int f_b_bf16, int rank, const float* dt_bias, const float* a_exp,
              const float* b_raw, const float* gate, const float* norm_w, const float* state_in, float* state_out,
              float* q, float* k, float* v, float* g, float* beta, float* new_win, float* out, int n_tok, int heads,
              int d, int kern, int bounded, float lower_bound, float eps) {
    extern __shared__ float sm[];
    float* s = sm;                      // [d, d]
    float* kv = s + d * d;              // k [d]
    float* qv = kv + d;                 // q [d]
    float* dec = qv + d;                // exp(g) [d]
    float* red = dec + d;               // [KDA_PARTS, d] partial sums
    float* scratch = red + KDA_PARTS * d;  // [KDA_PARTS, 32] for part_sum
    int h = blockIdx.x, j = threadIdx.x, p = threadIdx.y;
    int tid = p * blockDim.x + j, nthreads = blockDim.x * blockDim.y;
    int c = heads * d, hist = kern - 1;
    bool live = j < d;
    int ch = h * d + j;

    // The old state into shared memory: asynchronously where the head's block is whole 16-byte words (it lands while
    // step 1 runs; each thread waits for its copies before step 2's first barrier), else plainly.
    const float* sh_in = state_in + (size_t)h * d * d;
    float* sh = state_out + (size_t)h * d * d;
    bool async_state = (d & 3) == 0;
    if (async_state) {
        u32 base = smem_addr(s);
        for (int i = tid; i < d * d / 4; i += nthreads) cp_async16<false>(base + 16 * i, sh_in + 4 * i, 16);
        cp_async_commit();
    } else {
        block_copy(s, sh_in, d * d, tid, nthreads);
    }
    // This channel's row of f_b asked of L2 now: step 1 reads it after the conv and the norms.
    if (live && p == 0) {
        int bytes = rank * (f_b_bf16 ? 2 : 4);
        const char* row = (const char*)f_b + (size_t)ch * bytes;
        for (int off = 0; off < bytes; off += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
    }

    // 1. Inputs.
    const float* raws[3] = {raw_q, raw_k, raw_v};
    float q_scale = powf((float)d, -0.5f);
    for (int t0 = 0; t0 < n_tok; t0 += KDA_PARTS) {
        int t = t0 + p;
        bool mine = live && t < n_tok;
        float vals[3] = {0.f, 0.f, 0.f};
        if (mine) kda_conv3(win, raws, taps, t, ch, c, kern, vals);
        float qq = part_sum(vals[0] * vals[0], scratch);
        float kk2 = part_sum(vals[1] * vals[1], scratch);
        if (mine) {
            size_t off = (size_t)t * c + ch;
            q[off] = vals[0] * (1.0f / sqrtf(qq + KDA_L2_EPS)) * q_scale;
            k[off] = vals[1] * (1.0f / sqrtf(kk2 + KDA_L2_EPS));
            v[off] = vals[2];
            g[off] = kda_gate<KDA_GATE_WORDS>(f_a + (size_t)t * rank, f_b, f_b_bf16, rank, ch, dt_bias[ch],
                                              a_exp[h], bounded, lower_bound);
            if (t == 0) {
                for (int i = 0; i < 3; i++) {
                    const float* w = win + (size_t)i * hist * c;
                    for (int r = 0; r < hist; r++) {
                        int src = r + n_tok;
                        new_win[((size_t)i * hist + r) * c + ch] =
                            src < hist ? w[(size_t)src * c + ch] : raws[i][(size_t)(src - hist) * c + ch];
                    }
                }
            }
        }
        if (j == 0 && t < n_tok) beta[(size_t)t * heads + h] = sigmoidf_(b_raw[(size_t)t * heads + h]);
    }

    // 2. The recurrence (the block's writes above, and the state's copies, are visible after the barrier at the top of
    // each token).
    if (async_state) cp_async_wait_all();
    for (int t = 0; t < n_tok; t++) {
        size_t off = (size_t)t * c + (size_t)h * d;
        __syncthreads();
        for (int i = tid; i < d; i += nthreads) {
            kv[i] = k[off + i];
            qv[i] = q[off + i];
            dec[i] = expf(g[off + i]);
        }
        __syncthreads();
        float u = 0.f;
        if (live) {
            for (int kk = p; kk < d; kk += KDA_PARTS) {
                float x = s[kk * d + j] * dec[kk];
                s[kk * d + j] = x;
                u += x * kv[kk];
            }
            red[p * d + j] = u;
        }
        __syncthreads();
        float b = beta[(size_t)t * heads + h];
        float o = 0.f;
        if (live) {
            float uu = 0.f;
            for (int i = 0; i < KDA_PARTS; i++) uu += red[i * d + j];
            float delta = b * (v[off + j] - uu);
            for (int kk = p; kk < d; kk += KDA_PARTS) {
                float x = s[kk * d + j] + kv[kk] * delta;
                s[kk * d + j] = x;
                o += x * qv[kk];
            }
        }
        __syncthreads();
        if (live) red[p * d + j] = o;
        __syncthreads();
        if (live && p == 0) {
            float oo = 0.f;
            for (int i = 0; i < KDA_PARTS; i++) oo += red[i * d + j];
            out[off + j] = oo;
        }
    }
    __syncthreads();

    // 3. The gated norm of every token's row, tokens across the parts.
    for (int t0 = 0; t0 < n_tok; t0 += KDA_PARTS) {
        int t = t0 + p;
        bool mine = live && t < n_tok;
        size_t off = (size_t)t * c + ch;
        float x = mine ? out[off] : 0.f;
        float ss = part_sum(x * x, scratch);
        float inv = 1.0f / sqrtf(ss / (float)d + eps);
        if (mine) out[off] = (x * inv) * norm_w[j] * sigmoidf_(gate[off]);
    }

    // The new state.
    block_copy(sh, s, d * d, tid, nthreads);
}

// MLA's absorbed matrices laid out from `kv_b` `[heads * (nope + v), kvl]` as uploaded (bf16 bits when `bf16` is
// non-zero, else f32): per head its nope key rows, then its value rows. Writes every head's `W_UK,h` transposed,
// `uk_t [heads][kvl][nope]`, and every head's `W_UV,h` as stored, `uv [heads][v][kvl]`: the host's `gpu_absorbed`,
// value for value (a bf16 value widens to f32 exactly). One thread per element of `kv_b`, grid-strided.
extern "C" __global__ void mla_absorb(const void* kv_b, int bf16, int heads, int nope, int vd, int kvl, float* uk_t,
                                      float* uv) {
    const long long per_head = (long long)(nope + vd) * kvl;
    const long long total = per_head * heads;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        float x = bf16 ? __uint_as_float((unsigned)((const unsigned short*)kv_b)[i] << 16) : ((const float*)kv_b)[i];
        long long h = i / per_head;
        long long within = i - h * per_head;
        int r = (int)(within / kvl);
        int c = (int)(within - (long long)r * kvl);
        if (r < nope) {
            uk_t[(h * kvl + c) * nope + r] = x;
        } else {
            uv[h * vd * kvl + within - (long long)nope * kvl] = x;
        }
    }
}

// MLA's RMSNorms on rows (the CPU's `ops::rms_norm_row`): one block per row t; the row's first `normed` values
// become x * inv_rms(those values) * w, the next `copied` values are copied unchanged. src: rows of `src_stride`
// floats; dst: rows of `dst_stride` (it may be src itself: every value is read before the reduction and written
// after it by the same thread). Used in place on the query's low-rank rows (`copied` = 0) and to write the compressed
// KV (c normalised, k_pe raw) straight into the device cache.
extern "C" __global__ void mla_norm_rows(const float* src, int src_stride, float* dst, int dst_stride,
                                         const float* w, int normed, int copied, float eps) {
    __shared__ float scratch[32];
    const float* x = src + (size_t)blockIdx.x * src_stride;
    float* y = dst + (size_t)blockIdx.x * dst_stride;
    float ss = 0.f;
    for (int i = threadIdx.x; i < normed; i += blockDim.x) ss += x[i] * x[i];
    ss = part_sum(ss, scratch);
    float inv = 1.0f / sqrtf(ss / (float)normed + eps);
    for (int i = threadIdx.x; i < normed; i += blockDim.x) y[i] = x[i] * inv * w[i];
    for (int i = threadIdx.x; i < copied; i += blockDim.x) y[normed + i] = x[normed + i];
}

// Absorbed MLA for one (head, query token) per block:
//   q_abs = W_UK,h^T q_nope;  score_s = (q_abs . c_s + q_pe . kpe_s) * scale for s < past + t + 1;
//   p = softmax(score);  ctx = sum_s p_s c_s;  out = (W_UV,h ctx) * sigma(gate) (no factor when !gated).
// q: [T, H, nope + rope]; cache: [N, kvl + rope] (c normalised, k_pe raw), rows past.. are this call's tokens;
// w_uk_t: [H, kvl, nope]; w_uv: [H, vd, kvl]; scores: scratch [H, T, N]; gate, out: [T, H, vd].
#define MLA_THREADS 512
#define MLA_RPW 8

// y[r] = W[r, :] . v for the `rows` rows of W [rows, n] (global, read once, streamed past L1) and v [n] (shared),
// by every warp of the block: each warp takes MLA_RPW rows at a time and loads all of their 16-byte words before it
// sums any, so a block keeps enough bytes in flight for one head's weights at the SM's share of HBM. Rows whose
// start or whose v is not 16-byte aligned (n % 4 != 0) go one float at a time.
__device__ void mla_rows_dot(const float* w, const float* v, float* y, int rows, int n) {
    int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1), nwarps = blockDim.x / WARP;
    bool vec = (n & 3) == 0 && (((size_t)w | (size_t)v) & 15) == 0;
    for (int r0 = warp * MLA_RPW; r0 < rows; r0 += nwarps * MLA_RPW) {
        float a[MLA_RPW];
#pragma unroll
        for (int r = 0; r < MLA_RPW; r++) a[r] = 0.f;
        if (vec) {
            const float4* v4 = (const float4*)v;
            for (int i = lane; i < n / 4; i += WARP) {
                float4 p[MLA_RPW];
#pragma unroll
                for (int r = 0; r < MLA_RPW; r++)
                    p[r] = r0 + r < rows ? __ldcs((const float4*)(w + (size_t)(r0 + r) * n) + i)
                                         : make_float4(0.f, 0.f, 0.f, 0.f);
                float4 x = v4[i];
#pragma unroll
                for (int r = 0; r < MLA_RPW; r++) a[r] += p[r].x * x.x + p[r].y * x.y + p[r].z * x.z + p[r].w * x.w;
            }
        } else {
            for (int i = lane; i < n; i += WARP)
#pragma unroll
                for (int r = 0; r < MLA_RPW; r++)
                    if (r0 + r < rows) a[r] += w[(size_t)(r0 + r) * n + i] * v[i];
        }
#pragma unroll
        for (int r = 0; r < MLA_RPW; r++) {
            float sum = warp_sum(a[r]);
            if (lane == 0 && r0 + r < rows) y[r0 + r] = sum;
        }
    }
}

extern "C" __global__ void __launch_bounds__(MLA_THREADS)
    mla_attend(const float* q, const float* cache, const float* w_uk_t, const float* w_uv, float* scores,
               const float* gate, int gated, float* out, int n_tok, int past, int n_cache, int heads, int nope,
               int rope, int kvl, int vd, float scale) {
    extern __shared__ float sm[];
    int h = blockIdx.x, t = blockIdx.y;
    int qk = nope + rope, row = kvl + rope;
    float* q_abs = sm;           // [kvl]
    float* qh = q_abs + kvl;     // [qk]
    float* ctx = qh + qk;        // [kvl]
    float* red = ctx + kvl;      // [MLA_THREADS / WARP]
    int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    int nwarps = blockDim.x / WARP;
    const float* qsrc = q + ((size_t)t * heads + h) * qk;
    for (int i = threadIdx.x; i < qk; i += blockDim.x) qh[i] = qsrc[i];
    __syncthreads();
    // q_abs = W_UK,h^T q_nope: MLA_RPW rows a warp at once, the lanes along them.
    mla_rows_dot(w_uk_t + (size_t)h * kvl * nope, qh, q_abs, kvl, nope);
    __syncthreads();
    int visible = past + t + 1;
    float* sc = scores + ((size_t)h * n_tok + t) * n_cache;
    // One warp per cached row.
    for (int s = warp; s < visible; s += nwarps) {
        const float* r = cache + (size_t)s * row;
        float a = 0.f;
        for (int l = lane; l < kvl; l += WARP) a += q_abs[l] * r[l];
        float b = 0.f;
        for (int l = lane; l < rope; l += WARP) b += qh[nope + l] * r[kvl + l];
        a = warp_sum(a);
        b = warp_sum(b);
        if (lane == 0) sc[s] = (a + b) * scale;
    }
    __syncthreads();
    // max
    float m = NEG_INF;
    for (int s = threadIdx.x; s < visible; s += blockDim.x) m = fmaxf(m, sc[s]);
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float mm = red[0];
        for (int i = 1; i < nwarps; i++) mm = fmaxf(mm, red[i]);
        red[0] = mm;
    }
    __syncthreads();
    m = red[0];
    __syncthreads();
    float total = 0.f;
    for (int s = threadIdx.x; s < visible; s += blockDim.x) {
        float e = expf(sc[s] - m);
        sc[s] = e;
        total += e;
    }
    total = warp_sum(total);
    if (lane == 0) red[warp] = total;
    __syncthreads();
    if (threadIdx.x == 0) {
        float tt = 0.f;
        for (int i = 0; i < nwarps; i++) tt += red[i];
        red[0] = tt;
    }
    __syncthreads();
    total = red[0];
    for (int l = threadIdx.x; l < kvl; l += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < visible; s++) a += (sc[s] / total) * cache[(size_t)s * row + l];
        ctx[l] = a;
    }
    __syncthreads();
    // out = W_UV,h ctx, gated.
    float* dst = out + ((size_t)t * heads + h) * vd;
    mla_rows_dot(w_uv + (size_t)h * vd * kvl, ctx, dst, vd, kvl);
    if (gated) {
        __syncthreads();
        const float* g = gate + ((size_t)t * heads + h) * vd;
        for (int i = threadIdx.x; i < vd; i += blockDim.x) dst[i] *= sigmoidf_(g[i]);
    }
}
