// Routed experts in MXFP4 (compressed-tensors layout, see crates/quant/src/mxfp4.rs), all experts of a layer per
// launch:
//   moe_gate_up: act[p, :] = glu(W1_e . x[row(p)], W3_e . x[row(p)])   (gate and up fused, one pass over both)
//   moe_down:    y[p, :]   = W2_e . act[p, :]
//   moe_combine: out[t, :] = sum_j w[t, j] y[pair(t, j), :]             (in the router's order)
// where p runs over (expert, token) pairs. Pairs of one expert are consecutive: slot s owns pairs
// [pair0, pair0 + n_rows).
//
// Work split: grid.y = expert slot, grid.x = blocks of output rows; a warp owns ROWS_PER_WARP output rows. A lane
// reads one 16-byte chunk of a row = one 32-wide group with one E8M0 scale, so each weight byte is read once per
// token tile. Activations of up to TT tokens are staged in shared memory with the 16-byte chunks of each group
// XOR-swizzled, so the eight lanes of a quarter warp (eight consecutive groups) hit eight distinct bank quads.
//
// Decoding: a nibble s|m2 m1 m0 becomes the fp16 bits (s << 15) | (m << 9), which is exactly E2M1 * 2^-14 (the
// subnormal code 1 included); the group's partial sum is multiplied by 2^14 and then by the E8M0 scale, both exact
// power-of-two steps. Four 16-bit lanes are built with one shift-and-mask each per pair of elements.

#define MOE_WARPS 8
#define MOE_THREADS (MOE_WARPS * WARP)
#define ROWS_PER_WARP 4
#define MOE_ROWS_PER_BLOCK (MOE_WARPS * ROWS_PER_WARP)
#define GROUP 32
#define UNROLL 4

// One routed expert of this launch. Must match `ExpertSlot` in crates/model/src/gpu/experts.rs.
struct ExpertSlot {
    u64 w1, s1, w2, s2, w3, s3; // device addresses: packed and scales of gate (w1), down (w2), up (w3)
    int n_rows;                 // tokens routed to this expert
    int pair0;                  // first pair of this expert
};

__device__ __forceinline__ float e8m0(u32 e) {
    // 2^(e - 127): the normal float with biased exponent e; e = 0 is the subnormal 2^-127.
    return e == 0 ? __int_as_float(0x00400000) : __int_as_float((int)(e << 23));
}

__device__ __forceinline__ float half_lo(u32 h) {
    float f;
    unsigned short s = (unsigned short)(h & 0xffffu);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}

__device__ __forceinline__ float half_hi(u32 h) {
    float f;
    unsigned short s = (unsigned short)(h >> 16);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}

// Eight E2M1 codes of one packed word (byte j: element 2j low nibble, 2j+1 high nibble) as E2M1 * 2^-14.
__device__ __forceinline__ void decode8(u32 w, float f[8]) {
    u32 h04 = ((w & 0x00070007u) << 9) | ((w & 0x00080008u) << 12); // elements 0 and 4
    u32 h15 = ((w & 0x00700070u) << 5) | ((w & 0x00800080u) << 8);  // elements 1 and 5
    u32 h26 = ((w & 0x07000700u) << 1) | ((w & 0x08000800u) << 4);  // elements 2 and 6
    u32 h37 = ((w & 0x70007000u) >> 3) | (w & 0x80008000u);         // elements 3 and 7
    f[0] = half_lo(h04);
    f[4] = half_hi(h04);
    f[1] = half_lo(h15);
    f[5] = half_hi(h15);
    f[2] = half_lo(h26);
    f[6] = half_hi(h26);
    f[3] = half_lo(h37);
    f[7] = half_hi(h37);
}

// Shared-memory float4 index of chunk c (0..8) of group g in a staged row.
__device__ __forceinline__ int swz(int g, int c) { return g * 8 + (c ^ (g & 7)); }

// Stages rows `rows[i]` (i < count) of `src` (`cols` wide) into shared memory; rows i >= count (up to TT) are
// zeroed so every lane can run the full tile.
template <int TT>
__device__ __forceinline__ void stage_rows(float4* xs, const float* src, const int* rows, int count, int cols) {
    int chunks = cols / 4;
    for (int i = 0; i < TT; i++) {
        const float4* s = (i < count) ? (const float4*)(src + (size_t)rows[i] * cols) : 0;
        for (int q = threadIdx.x; q < chunks; q += blockDim.x) {
            float4 v = s ? s[q] : make_float4(0.f, 0.f, 0.f, 0.f);
            xs[i * chunks + swz(q >> 3, q & 7)] = v;
        }
    }
}

// Accumulates one 32-group: part[t] += sum_i w_i x_t[i] (weights as E2M1 * 2^-14).
template <int TT>
__device__ __forceinline__ void group_dot(uint4 p, const float4* xs, int chunks, int g, float part[TT]) {
    u32 words[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
    for (int wi = 0; wi < 4; wi++) {
        float f[8];
        decode8(words[wi], f);
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int c = wi * 2 + half;
#pragma unroll
            for (int t = 0; t < TT; t++) {
                float4 xv = xs[t * chunks + swz(g, c)];
                float s = part[t];
                s = fmaf(f[half * 4 + 0], xv.x, s);
                s = fmaf(f[half * 4 + 1], xv.y, s);
                s = fmaf(f[half * 4 + 2], xv.z, s);
                s = fmaf(f[half * 4 + 3], xv.w, s);
                part[t] = s;
            }
        }
    }
}

// acc[t] += W[row] . x_t for one MXFP4 row (this lane's groups only).
template <int TT>
__device__ __forceinline__ void row_dot(const u8* packed, const u8* scales, int row, int cols, const float4* xs,
                                        float acc[TT]) {
    int groups = cols / GROUP;
    int chunks = cols / 4;
    const uint4* prow = (const uint4*)(packed + (size_t)row * (cols / 2));
    const u8* srow = scales + (size_t)row * groups;
    int lane = threadIdx.x & (WARP - 1);
    for (int gb = 0; gb < groups; gb += WARP * UNROLL) {
        uint4 p[UNROLL];
        u32 e[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int g = gb + u * WARP + lane;
            if (g < groups) {
                p[u] = __ldg(prow + g);
                e[u] = __ldg(srow + g);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int g = gb + u * WARP + lane;
            if (g < groups) {
                float part[TT];
#pragma unroll
                for (int t = 0; t < TT; t++) part[t] = 0.f;
                group_dot<TT>(p[u], xs, chunks, g, part);
                float sc = e8m0(e[u]);
#pragma unroll
                for (int t = 0; t < TT; t++) acc[t] = fmaf(part[t] * 16384.0f, sc, acc[t]);
            }
        }
    }
}

// Gate and up fused: both rows are read in the same pass over the group chunks.
template <int TT>
__device__ __forceinline__ void row_dot2(const u8* pa, const u8* sa, const u8* pb, const u8* sb, int row, int cols,
                                         const float4* xs, float acc_a[TT], float acc_b[TT]) {
    int groups = cols / GROUP;
    int chunks = cols / 4;
    const uint4* ra = (const uint4*)(pa + (size_t)row * (cols / 2));
    const uint4* rb = (const uint4*)(pb + (size_t)row * (cols / 2));
    const u8* ea = sa + (size_t)row * groups;
    const u8* eb = sb + (size_t)row * groups;
    int lane = threadIdx.x & (WARP - 1);
    for (int gb = 0; gb < groups; gb += WARP * UNROLL) {
        uint4 p[UNROLL], q[UNROLL];
        u32 e[UNROLL], f[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int g = gb + u * WARP + lane;
            if (g < groups) {
                p[u] = __ldg(ra + g);
                q[u] = __ldg(rb + g);
                e[u] = __ldg(ea + g);
                f[u] = __ldg(eb + g);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int g = gb + u * WARP + lane;
            if (g < groups) {
                float part_a[TT], part_b[TT];
#pragma unroll
                for (int t = 0; t < TT; t++) {
                    part_a[t] = 0.f;
                    part_b[t] = 0.f;
                }
                group_dot<TT>(p[u], xs, chunks, g, part_a);
                group_dot<TT>(q[u], xs, chunks, g, part_b);
                float sa_ = e8m0(e[u]), sb_ = e8m0(f[u]);
#pragma unroll
                for (int t = 0; t < TT; t++) {
                    acc_a[t] = fmaf(part_a[t] * 16384.0f, sa_, acc_a[t]);
                    acc_b[t] = fmaf(part_b[t] * 16384.0f, sb_, acc_b[t]);
                }
            }
        }
    }
}

// act[pair, :inter] = glu(W1 x, W3 x) for every pair of every slot. x is [n_x_rows, width]; pair_row[p] is the
// x row of pair p.
template <int TT>
__device__ void moe_gate_up_impl(const ExpertSlot* slots, const int* pair_row, const float* x, float* act,
                                 int width, int inter, int act_kind, float beta, float lin_beta) {
    extern __shared__ float4 smem[];
    const ExpertSlot s = slots[blockIdx.y];
    int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    int row0 = blockIdx.x * MOE_ROWS_PER_BLOCK + warp * ROWS_PER_WARP;
    for (int t0 = 0; t0 < s.n_rows; t0 += TT) {
        int count = min(TT, s.n_rows - t0);
        __syncthreads();
        stage_rows<TT>(smem, x, pair_row + s.pair0 + t0, count, width);
        __syncthreads();
        for (int r = 0; r < ROWS_PER_WARP; r++) {
            int row = row0 + r;
            if (row >= inter) break;
            float ga[TT], ub[TT];
#pragma unroll
            for (int t = 0; t < TT; t++) {
                ga[t] = 0.f;
                ub[t] = 0.f;
            }
            row_dot2<TT>((const u8*)s.w1, (const u8*)s.s1, (const u8*)s.w3, (const u8*)s.s3, row, width, smem, ga,
                         ub);
#pragma unroll
            for (int t = 0; t < TT; t++) {
                float g = warp_sum(ga[t]);
                float u = warp_sum(ub[t]);
                if (lane == 0 && t < count)
                    act[(size_t)(s.pair0 + t0 + t) * inter + row] = glu(act_kind, beta, lin_beta, g, u);
            }
        }
    }
}

// y[pair, :width] = W2 act[pair, :inter].
template <int TT>
__device__ void moe_down_impl(const ExpertSlot* slots, const float* act, float* y, int width, int inter) {
    extern __shared__ float4 smem[];
    const ExpertSlot s = slots[blockIdx.y];
    int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    int row0 = blockIdx.x * MOE_ROWS_PER_BLOCK + warp * ROWS_PER_WARP;
    __shared__ int rows[TT];
    for (int t0 = 0; t0 < s.n_rows; t0 += TT) {
        int count = min(TT, s.n_rows - t0);
        __syncthreads();
        if (threadIdx.x < TT) rows[threadIdx.x] = s.pair0 + t0 + threadIdx.x;
        __syncthreads();
        stage_rows<TT>(smem, act, rows, count, inter);
        __syncthreads();
        for (int r = 0; r < ROWS_PER_WARP; r++) {
            int row = row0 + r;
            if (row >= width) break;
            float acc[TT];
#pragma unroll
            for (int t = 0; t < TT; t++) acc[t] = 0.f;
            row_dot<TT>((const u8*)s.w2, (const u8*)s.s2, row, inter, smem, acc);
#pragma unroll
            for (int t = 0; t < TT; t++) {
                float v = warp_sum(acc[t]);
                if (lane == 0 && t < count) y[(size_t)(s.pair0 + t0 + t) * width + row] = v;
            }
        }
    }
}

#define MOE_ENTRY(TT)                                                                                           \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS) moe_gate_up_t##TT(                                \
        const ExpertSlot* slots, const int* pair_row, const float* x, float* act, int width, int inter,        \
        int act_kind, float beta, float lin_beta) {                                                             \
        moe_gate_up_impl<TT>(slots, pair_row, x, act, width, inter, act_kind, beta, lin_beta);                  \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS)                                                   \
        moe_down_t##TT(const ExpertSlot* slots, const float* act, float* y, int width, int inter) {            \
        moe_down_impl<TT>(slots, act, y, width, inter);                                                         \
    }

MOE_ENTRY(1)
MOE_ENTRY(2)
MOE_ENTRY(4)
MOE_ENTRY(8)

// out[t, c] = sum_j w[t, j] y[pair[t, j], c], j in router order (as the CPU combine).
extern "C" __global__ void moe_combine(const float* y, const int* tok_pair, const float* tok_w, int k, int width,
                                       float* out) {
    int t = blockIdx.y;
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    float acc = 0.f;
    for (int j = 0; j < k; j++) {
        int p = tok_pair[t * k + j];
        if (p >= 0) acc += tok_w[t * k + j] * y[(size_t)p * width + c];
    }
    out[(size_t)t * width + c] = acc;
}
