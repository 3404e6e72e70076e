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

// ---------------------------------------------------------------------------------------------------------------
// Tensor-core path (the default): the same three products with `mma.sync.m16n8k16` (fp16 inputs, f32 accumulate).
//
// Weights. A nibble s|e1 e0 m becomes the fp16 bits (s << 15) | (e1 e0 m << 9), exactly E2M1 * 2^-14 (the E2M1
// subnormal lines up with the fp16 one). Per 32-bit packed word (elements 0..7): the fp16 high bytes of the even
// and of the odd elements are built with three or four integer ops, then split into four half2 registers by one
// `prmt` or one mask each: (e0, e4), (e2, e6), (e1, e5), (e3, e7). About 1.4 integer ops per weight element, no
// conversion, no FMA.
//
// Activations. A token's row x is scaled by 2^s (a power of two chosen from max |x| so that the largest element
// lands in [2^14, 2^15)) and split into x_hi = fp16(x 2^s) and x_lo = fp16(x 2^s - x_hi): 22 significant bits, so
// w.x = w.x_hi + w.x_lo keeps f32 accuracy (each fp16 product is exact in the f32 accumulator).
//
// Fragments. A warp owns NM streams of 16 rows (gate+up: NM/2 row tiles of W1 and of W3; down: NM row tiles of
// W2). Lane (g, c) (g = lane / 4, c = lane % 4) loads the 16-byte group 4b + c of rows g and g + 8 of every
// stream for batch b (four consecutive groups per batch, so a row's 64 bytes are read by four neighbouring
// lanes). In the mma, the k slots of lane c therefore always hold group 4b + c. The B operand puts group c's
// activations in output columns 2c (x_hi) and 2c + 1 (x_lo) and zeros elsewhere, so one accumulator keeps the four
// groups (and the hi/lo halves) apart: after the eight mmas of a batch, lane c holds exactly the partial sums of
// its own group for rows g and g + 8, multiplies them by that group's E8M0 scale and adds them to f32 row sums.
// The quad's four lanes are summed once per row at the end. Only the eight lanes with c == g / 2 read a
// non-zero B fragment; the others read a zero block of shared memory (a broadcast).
//
// Streaming. Each lane copies its own chunks (16 bytes of weights, the 4-byte word holding its scale byte) with
// cp.async into a per-warp ring of S stages, S - 1 batches ahead of the batch being multiplied (the first ones
// while the activations are staged), so no registers hold data in flight. An L2 miss fetches 256 bytes (four
// batches of a row). Blocks of 4 warps, 16 rows of gate and of up (or 32 rows of down) per warp: 114 registers,
// four blocks per multiprocessor. (Measured on the H200: 8-warp blocks or a register cap for more blocks per
// multiprocessor were slower; see docs/PERFORMANCE.md.)
//
// Shared memory: per token [groups rounded up to 4][hi, lo][32 halves], the halves of each 8-element word in the
// order (0, 4, 2, 6, 1, 5, 3, 7) that the two mmas of the word consume; a zero block of 64 bytes; then the rings:
// [warp][stage][stream][row][lane] 16-byte weight chunks, then [warp][stage][stream][row][lane] scale words.

#define MMA_WARPS 4
#define MMA_THREADS (MMA_WARPS * WARP)
#define MMA_STAGES 3
#define MAX_SLOTS 64

// The experts of one launch, passed by value (no upload before the launch). Must match `SlotTable` in
// crates/quant/src/cuda/moe.rs.
struct SlotTable {
    ExpertSlot s[MAX_SLOTS];
};

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ u32 f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Four half2 of E2M1 * 2^-14 from one packed word: h[0] = (e0, e4), h[1] = (e2, e6), h[2] = (e1, e5),
// h[3] = (e3, e7) (low half first).
__device__ __forceinline__ void decode_h2(u32 w, u32 h[4]) {
    u32 even = ((w << 1) & 0x0e0e0e0eu) | ((w << 4) & 0x80808080u); // byte k: fp16 high byte of element 2k
    u32 odd = ((w >> 3) & 0x0e0e0e0eu) | (w & 0x80808080u);         // byte k: element 2k + 1
    h[0] = prmt(even, 0u, 0x2404u);
    h[1] = even & 0xff00ff00u;
    h[2] = prmt(odd, 0u, 0x2404u);
    h[3] = odd & 0xff00ff00u;
}

// d += A . B for one m16n8k16 tile (A row-major 16x16 fp16, B column-major 16x8 fp16, f32 accumulators).
__device__ __forceinline__ void mma16816(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The tensor cores' rate for `mma.sync.m16n8k16` (fp16 inputs, f32 accumulators) with nothing else in the loop: each
// warp runs `iters` rounds of eight independent mmas on operands held in registers, and writes one sum (so nothing
// is optimised away). The ceiling of the mma.sync kernels above (`quant::cuda::copy_rate::mma_sync_rate`).
extern "C" __global__ void mma_peak(float* out, int iters) {
    float d[8][4];
#pragma unroll
    for (int k = 0; k < 8; k++) d[k][0] = d[k][1] = d[k][2] = d[k][3] = 0.f;
    // A: fp16 1.0 in both lanes; B: 2^-10 in both lanes, on odd threads the next fp16 value up. The sums stay small
    // and finite for any iteration count used.
    const u32 a = 0x3c003c00u, b = 0x14001400u ^ (threadIdx.x & 1u);
    for (int i = 0; i < iters; i++) {
#pragma unroll
        for (int k = 0; k < 8; k++) mma16816(d[k], a, a, a, a, b, b);
    }
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < 8; k++) sum += d[k][0] + d[k][1] + d[k][2] + d[k][3];
    if ((threadIdx.x & (WARP - 1)) == 0) out[(blockIdx.x * blockDim.x + threadIdx.x) / WARP] = sum;
}

__device__ __forceinline__ u32 word_of(uint4 v, int q) { return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w; }

// The factors of a row whose largest magnitude is mm: up = 2^s with mm * 2^s in [2^14, 2^15) (s clamped so both
// factors stay normal floats), down = 2^(14 - s), which turns a row sum of E2M1 * 2^-14 weights back into w.x.
__device__ __forceinline__ void hilo_factors(float mm, float* up, float* down) {
    int e = (__float_as_int(mm) >> 23) & 0xff;
    int sh = mm > 0.f ? 141 - e : 0;
    sh = max(-112, min(126, sh));
    *up = __int_as_float((127 + sh) << 23);
    *down = __int_as_float((141 - sh) << 23);
}

// Stages tokens rows[0..count) of `src` (`cols` wide) as fp16 hi/lo fragments (layout above); tokens count..TT
// and the padding groups are zeros. s_down[t] receives 2^(14 - s_t), the factor that turns a row sum back into
// w.x. Ends with a barrier.
template <int TT>
__device__ void stage_hilo(uint4* xs, const float* src, const int rows[TT], int count, int cols, int gp,
                           float* s_up, float* s_down, float (*red)[TT]) {
    int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    int c4 = cols / 4;
    float m[TT];
#pragma unroll
    for (int t = 0; t < TT; t++) {
        m[t] = 0.f;
        if (t < count) {
            const float4* p = (const float4*)(src + (size_t)rows[t] * cols);
            for (int q = threadIdx.x; q < c4; q += blockDim.x) {
                float4 v = p[q];
                m[t] = fmaxf(m[t], fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
            }
        }
        m[t] = warp_max(m[t]);
        if (lane == 0) red[warp][t] = m[t];
    }
    __syncthreads();
    if (threadIdx.x < TT) {
        int t = threadIdx.x;
        float mm = 0.f;
        for (int w = 0; w < (int)(blockDim.x / WARP); w++) mm = fmaxf(mm, red[w][t]);
        hilo_factors(mm, &s_up[t], &s_down[t]);
    }
    if (threadIdx.x < 4) xs[TT * gp * 8 + threadIdx.x] = make_uint4(0u, 0u, 0u, 0u);
    __syncthreads();
    // Four consecutive columns per item: one half of an 8-element word.
    int per_tok = gp * 8;
    for (int it = threadIdx.x; it < TT * per_tok; it += blockDim.x) {
        int t = it / per_tok, c = it - t * per_tok;
        int col = c * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        int row = rows[0];
#pragma unroll
        for (int k = 1; k < TT; k++)
            if (t == k) row = rows[k];
        if (t < count && col < cols) v = ((const float4*)(src + (size_t)row * cols))[c];
        float f = s_up[t];
        float vs[4] = {v.x * f, v.y * f, v.z * f, v.w * f};
        u32 hi[4], lo[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            hi[k] = f32_to_f16(vs[k]);
            lo[k] = f32_to_f16(vs[k] - half_lo(hi[k]));
        }
        int grp = col >> 5, within = col & 31, q = within >> 3, odd = (within >> 2) & 1;
        // Elements i = 4*odd + k go to positions bitrev3(i): (0, 4, 2, 6) for k = 0..3, plus 1 when odd.
        u16* base = (u16*)(xs + ((size_t)(t * gp + grp) * 2) * 4) + q * 8 + odd;
        u16* bl = base + 32;
        base[0] = (u16)hi[0];
        base[4] = (u16)hi[1];
        base[2] = (u16)hi[2];
        base[6] = (u16)hi[3];
        bl[0] = (u16)lo[0];
        bl[4] = (u16)lo[1];
        bl[2] = (u16)lo[2];
        bl[6] = (u16)lo[3];
    }
    __syncthreads();
}

// This lane's weight stream: for each stream i and row r (g, g + 8), the global address of its 16-byte chunk of
// batch 0 (group c) and of the aligned 4-byte word holding that group's scale byte (the byte sits at bit
// sshift[i][r]). Batch b adds 64 and 4 bytes. Each lane owns its ring slots: [stage][i][r][lane] 16 bytes of
// packed weights, then [stage][i][r][lane] 4 bytes of scales, per warp.
template <int NM>
struct LaneStream {
    const u8* wp[NM][2];
    const u8* sp[NM][2];
    u32 sshift[NM][2];
};

// Queues the copies of batch b into ring stage `st` (zeros past the last group) and commits them as one group.
template <int NM, int S, bool HINT>
__device__ __forceinline__ void issue_batch(const LaneStream<NM>& ls, u32 wring, u32 sring, int groups, int b,
                                            int st, int c, int lane) {
    bool ok = 4 * b + c < groups;
    u32 wbytes = ok ? 16u : 0u, sbytes = ok ? 4u : 0u;
    size_t bo = ok ? (size_t)b : 0;
#pragma unroll
    for (int i = 0; i < NM; i++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            u32 slot = (u32)(((st * NM + i) * 2 + r) * WARP + lane);
            cp_async16<HINT>(wring + slot * 16, ls.wp[i][r] + bo * 64, wbytes);
            cp_async4(sring + slot * 4, ls.sp[i][r] + bo * 4, sbytes);
        }
    cp_async_commit();
}

// The eight mmas of one batch for every stream and token, then acc[i][r][t] += scale * (hi + lo).
// xb: this lane's B fragments for this batch (the zero block for inactive lanes); tstride: uint4s between tokens
// (0 for inactive lanes).
template <int TT, int NM>
__device__ __forceinline__ void mma_batch(const uint4 w[NM][2], const u32 e[NM][2], const uint4* xb, int tstride,
                                          float acc[NM][2][TT]) {
    float d[NM][TT][4];
#pragma unroll
    for (int i = 0; i < NM; i++)
#pragma unroll
        for (int t = 0; t < TT; t++)
#pragma unroll
            for (int k = 0; k < 4; k++) d[i][t][k] = 0.f;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        u32 h[NM][2][4];
#pragma unroll
        for (int i = 0; i < NM; i++) {
            decode_h2(word_of(w[i][0], q), h[i][0]);
            decode_h2(word_of(w[i][1], q), h[i][1]);
        }
#pragma unroll
        for (int t = 0; t < TT; t++) {
            uint4 bv = xb[t * tstride + q];
#pragma unroll
            for (int i = 0; i < NM; i++) {
                mma16816(d[i][t], h[i][0][0], h[i][1][0], h[i][0][1], h[i][1][1], bv.x, bv.y);
                mma16816(d[i][t], h[i][0][2], h[i][1][2], h[i][0][3], h[i][1][3], bv.z, bv.w);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < NM; i++) {
        float s0 = e8m0(e[i][0]), s1 = e8m0(e[i][1]);
#pragma unroll
        for (int t = 0; t < TT; t++) {
            acc[i][0][t] = fmaf(s0, d[i][t][0] + d[i][t][1], acc[i][0][t]);
            acc[i][1][t] = fmaf(s1, d[i][t][2] + d[i][t][3], acc[i][1][t]);
        }
    }
}

// GATE_UP: act[pair, :inter] = glu(W1 x, W3 x); otherwise y[pair, :width] = W2 act[pair]. A warp covers
// NM / 2 (gate+up) or NM (down) row tiles of 16 rows.
template <int TT, int NM, bool GATE_UP, int S, int W, bool HINT>
__device__ void moe_mma_impl(const SlotTable& tab, const int* pair_row, const float* src, float* dst, int width,
                             int inter, int act_kind, float beta, float lin_beta) {
    extern __shared__ uint4 xs[];
    __shared__ float red[W][TT];
    __shared__ float s_up[TT], s_down[TT];
    const ExpertSlot& s = tab.s[blockIdx.y];
    constexpr int MT = GATE_UP ? NM / 2 : NM;
    const int cols = GATE_UP ? width : inter;
    const int nrows = GATE_UP ? inter : width;
    const int groups = cols / GROUP, gp = (groups + 3) & ~3, nb = gp / 4;
    const int rowbytes = cols / 2;
    int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    int g = lane >> 2, c = lane & 3;
    int row0 = (blockIdx.x * W + warp) * MT * 16;

    // This lane's rows g and g + 8 of every row tile. Rows past the end read the last row (and are not stored).
    const u8* mw[2] = {(const u8*)(GATE_UP ? s.w1 : s.w2), (const u8*)(GATE_UP ? s.w3 : s.w2)};
    const u8* ms[2] = {(const u8*)(GATE_UP ? s.s1 : s.s2), (const u8*)(GATE_UP ? s.s3 : s.s2)};
    LaneStream<NM> ls;
#pragma unroll
    for (int i = 0; i < NM; i++) {
        int mi = GATE_UP ? (i & 1) : 0, mt = GATE_UP ? i / 2 : i;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            size_t row = (size_t)min(row0 + mt * 16 + g + 8 * r, nrows - 1);
            ls.wp[i][r] = mw[mi] + row * rowbytes + (size_t)c * 16;
            const u8* sbyte = ms[mi] + row * groups + c;
            ls.sp[i][r] = (const u8*)((size_t)sbyte & ~(size_t)3);
            ls.sshift[i][r] = (u32)((size_t)sbyte & 3) * 8;
        }
    }
    // Per-warp rings after the B fragments: S stages of NM x 2 x 32 16-byte weight chunks, then of 4-byte scale
    // words.
    const int xs_len = TT * gp * 8 + 4;
    uint4* wring_p = xs + xs_len + warp * (S * NM * 2 * WARP);
    u32* sring_p = (u32*)(xs + xs_len + W * (S * NM * 2 * WARP)) + warp * (S * NM * 2 * WARP);
    const u32 wring = smem_addr(wring_p), sring = smem_addr(sring_p);

    // B fragment addressing: active lanes (c == g / 2) read group 4b + c, half g & 1.
    bool active = c == (g >> 1);
    int xoff = active ? (c * 2 + (g & 1)) * 4 : TT * gp * 8;
    int bstride = active ? 32 : 0;
    int tstride = active ? gp * 8 : 0;

    for (int t0 = 0; t0 < s.n_rows; t0 += TT) {
        int count = min(TT, s.n_rows - t0);
        int rows[TT];
#pragma unroll
        for (int t = 0; t < TT; t++) {
            int p = s.pair0 + t0 + min(t, count - 1);
            rows[t] = GATE_UP ? pair_row[p] : p;
        }
        // The first S - 1 batches stream in while the activations are staged.
#pragma unroll
        for (int k = 0; k < S - 1; k++) issue_batch<NM, S, HINT>(ls, wring, sring, groups, k, k, c, lane);
        __syncthreads();
        stage_hilo<TT>(xs, src, rows, count, cols, gp, s_up, s_down, red);

        float acc[NM][2][TT];
#pragma unroll
        for (int i = 0; i < NM; i++)
#pragma unroll
            for (int t = 0; t < TT; t++) acc[i][0][t] = acc[i][1][t] = 0.f;
        int st = 0;
        for (int b = 0; b < nb; b++) {
            // Refill the stage read in the previous iteration with batch b + S - 1, then wait for batch b.
            issue_batch<NM, S, HINT>(ls, wring, sring, groups, b + S - 1, st == 0 ? S - 1 : st - 1, c, lane);
            cp_async_wait<S - 1>();
            uint4 w[NM][2];
            u32 e[NM][2];
#pragma unroll
            for (int i = 0; i < NM; i++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    int slot = ((st * NM + i) * 2 + r) * WARP + lane;
                    w[i][r] = wring_p[slot];
                    e[i][r] = (sring_p[slot] >> ls.sshift[i][r]) & 0xffu;
                }
            mma_batch<TT, NM>(w, e, xs + xoff + b * bstride, tstride, acc);
            st = st == S - 1 ? 0 : st + 1;
        }
        cp_async_wait_all();

        // Sum the quad's four groups-of-a-batch partial sums, then scale back and store.
#pragma unroll
        for (int i = 0; i < NM; i++)
#pragma unroll
            for (int r = 0; r < 2; r++)
#pragma unroll
                for (int t = 0; t < TT; t++) {
                    float v = acc[i][r][t];
                    v += __shfl_xor_sync(FULL_MASK, v, 1);
                    v += __shfl_xor_sync(FULL_MASK, v, 2);
                    acc[i][r][t] = v * s_down[t];
                }
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                int row = row0 + mt * 16 + g + 8 * r;
                if (row >= nrows) continue;
#pragma unroll
                for (int t = 0; t < TT; t++) {
                    if (t >= count || (t & 3) != c) continue;
                    size_t p = (size_t)(s.pair0 + t0 + t);
                    if (GATE_UP)
                        dst[p * inter + row] =
                            glu(act_kind, beta, lin_beta, acc[2 * mt][r][t], acc[2 * mt + 1][r][t]);
                    else
                        dst[p * width + row] = acc[mt][r][t];
                }
            }
    }
}

// Entry points: moe_mma_{gate_up,down}_t<TT>_m<NM><SUFFIX>: TT tokens per tile, NM row streams per warp, 4-warp
// blocks, at most 168 registers (3 blocks per multiprocessor; the one-token kernels need 114-116, so 4 fit), S ring
// stages, HINT: the 256-byte L2 prefetch on weight copies.
#define MOE_MMA_ENTRY(TT, NM, S, HINT, SUFFIX)                                                                  \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS, 3)                                                \
        moe_mma_gate_up_t##TT##_m##NM##SUFFIX(const __grid_constant__ SlotTable tab, const int* pair_row,       \
                                              const float* x, float* act, int width, int inter, int act_kind,  \
                                              float beta, float lin_beta) {                                    \
        moe_mma_impl<TT, NM, true, S, MMA_WARPS, HINT>(tab, pair_row, x, act, width, inter, act_kind, beta,     \
                                                       lin_beta);                                              \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS, 3) moe_mma_down_t##TT##_m##NM##SUFFIX(            \
        const __grid_constant__ SlotTable tab, const float* act, float* y, int width, int inter) {             \
        moe_mma_impl<TT, NM, false, S, MMA_WARPS, HINT>(tab, 0, act, y, width, inter, 0, 1.f, 1.f);             \
    }

MOE_MMA_ENTRY(1, 2, MMA_STAGES, true, )
MOE_MMA_ENTRY(2, 2, MMA_STAGES, true, )
MOE_MMA_ENTRY(4, 2, MMA_STAGES, true, )
// Measurement variants at one token: four ring stages; no L2 prefetch hint.
MOE_MMA_ENTRY(1, 2, 4, true, _s4)
MOE_MMA_ENTRY(1, 2, MMA_STAGES, false, _nohint)

// ---------------------------------------------------------------------------------------------------------------
// Many tokens per expert (prefill passes, speculative verification): the same exact products as one GEMM per
// expert on the tensor cores, tokens along the mma's n dimension, so a weight is read and decoded once per tile of
// up to 8 * NT tokens instead of once per token.
//
// Activations. `moe_split_hilo` scales each row by its power of two and splits it into fp16 hi/lo once (as
// `stage_hilo`), into global memory: frag[row][group] = 8 uint4 (hi words 0..3, then lo words 0..3, each word's
// halves in the order (0, 4, 2, 6, 1, 5, 3, 7)), and sdown[row] = 2^(14 - s_row).
//
// Weights. Lane (g, c) reads word c (elements 8c .. 8c + 7) of every group of rows g and g + 8, so the two k-tiles
// of a group hold that group alone (k slots of lane c: the word's elements (0, 4, 2, 6), then (1, 5, 3, 7)) and its
// E8M0 scale applies once the group's four mmas (hi and lo of both k-tiles) are summed. The B fragment of lane
// (g, c) in n-tile j is token 8j + g's hi (then lo) word c of the group: eight tokens per mma, all of them useful.
// A warp owns two row streams (gate and up of 16 rows, or 32 rows of down) and every n-tile of its token tile;
// blocks of 4 warps; grid (row blocks, experts, token tiles).

#define GEMM_WARPS 4
#define GEMM_THREADS (GEMM_WARPS * WARP)

// frag and sdown of row blockIdx.x of src ([rows, cols], cols a multiple of 128).
// The fp16 hi and lo halves of the eight values at x (16-byte aligned) times f, as four words each: halves (0, 4),
// (2, 6), (1, 5), (3, 7), low half first (the order the mmas of a word consume).
__device__ __forceinline__ void split_word(const float* x, float f, u32 hw[4], u32 lw[4]) {
    const float4* p = (const float4*)x;
    float4 a = p[0], b = p[1];
    float v[8] = {a.x * f, a.y * f, a.z * f, a.w * f, b.x * f, b.y * f, b.z * f, b.w * f};
    u32 hi[8], lo[8];
#pragma unroll
    for (int k = 0; k < 8; k++) {
        hi[k] = f32_to_f16(v[k]);
        lo[k] = f32_to_f16(v[k] - half_lo(hi[k]));
    }
    hw[0] = hi[0] | (hi[4] << 16), hw[1] = hi[2] | (hi[6] << 16), hw[2] = hi[1] | (hi[5] << 16);
    hw[3] = hi[3] | (hi[7] << 16);
    lw[0] = lo[0] | (lo[4] << 16), lw[1] = lo[2] | (lo[6] << 16), lw[2] = lo[1] | (lo[5] << 16);
    lw[3] = lo[3] | (lo[7] << 16);
}

// The split factor of row `x` (`cols` wide), one block a row: 2^s for the split, with sdown = 2^(14 - s) stored.
__device__ __forceinline__ float split_factor(const float* x, int cols, float* sdown) {
    __shared__ float red[32];
    __shared__ float s_up;
    int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    float m = 0.f;
    for (int q = threadIdx.x; q < cols; q += blockDim.x) m = fmaxf(m, fabsf(x[q]));
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float mm = 0.f;
        for (int w = 0; w < (int)(blockDim.x / WARP); w++) mm = fmaxf(mm, red[w]);
        hilo_factors(mm, &s_up, sdown);
    }
    __syncthreads();
    return s_up;
}

extern "C" __global__ void moe_split_hilo(const float* src, int cols, float* sdown, uint4* frag) {
    const int row = blockIdx.x;
    const float* x = src + (size_t)row * cols;
    const float f = split_factor(x, cols, &sdown[row]);
    uint4* out = frag + (size_t)row * (cols / GROUP) * 8;
    for (int w = threadIdx.x; w < cols / 8; w += blockDim.x) {
        u32 hi[4], lo[4];
        split_word(x + (size_t)w * 8, f, hi, lo);
        int grp = w >> 2, q = w & 3;
        out[grp * 8 + q] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        out[grp * 8 + 4 + q] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
}

// Loads this lane's weight words and scale words of group batch b (groups 4b .. 4b + 3).
__device__ __forceinline__ void gemm_load(const u32* const wp[2][2], const u32* const sp[2][2], int b,
                                          u32 w[2][2][4], u32 e[2][2]) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            e[i][r] = __ldg(sp[i][r] + b);
#pragma unroll
            for (int q = 0; q < 4; q++) w[i][r][q] = __ldg(wp[i][r] + (4 * b + q) * 4);
        }
}

// Queues the B fragments of group batch b (groups 4b .. 4b + 3) of the tile's tokens into shared-memory buffer
// `buf`: [group q][token][8 uint4], the hi and lo halves swapped for odd tokens so that a quarter warp (tokens g and
// g + 1) reads 32 distinct banks. rows[] are the tile's frag rows (clamped).
template <int NT, int THREADS = GEMM_THREADS>
__device__ __forceinline__ void gemm_stage_b(uint4* buf, const uint4* frag, const int* rows, int groups, int b) {
    constexpr int ITEMS = NT * 8 * 32; // tokens x (4 groups x 8 uint4)
    static_assert(ITEMS % THREADS == 0, "whole items per thread");
#pragma unroll
    for (int it = 0; it < ITEMS / THREADS; it++) {
        int idx = it * THREADS + threadIdx.x;
        int tok = idx >> 5, u = idx & 31, q = u >> 3, w = u & 7;
        const uint4* src = frag + ((size_t)rows[tok] * groups + 4 * b + q) * 8 + w;
        uint4* dst = buf + ((q * NT * 8 + tok) * 8 + (w ^ ((tok & 1) * 4)));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src));
    }
    cp_async_commit();
}

// The GEMM with the E8M0 scales folded into the weights. A group whose scale byte e lies in [104, 128] has weights
// E2M1 * 2^(e - 127) that fp16 holds exactly (0.5 * 2^-23 = 2^-24 up to 6 * 2 = 12): the decoded E2M1 * 2^-14 is
// multiplied by the fp16 2^(e - 113) (exact: a power of two and a representable product), so the group's mmas add
// straight into the tile's running sums with no per-group scaling step. The tensor cores' f32 accumulation rounds
// toward zero, so the sums of one batch (four groups, sixteen chained mmas) start from zero and are added into
// the f32 accumulators once per batch, which keeps the drift of a long chain out. A group with any scale of the
// warp's rows outside the window (a warp-wide vote) runs as in `moe_gemm_impl`: its mmas into a zeroed tile, then
// times 2^14 and its scale into the accumulators. Sums are w.x * 2^s_t (s_t: the token's split factor), so the
// output is acc * sdown[t] * 2^-14.
//
// Layout as `moe_gemm_impl` (lane (g, c), word c of each group, B fragments through shared memory), with blocks of
// FOLD_WARPS warps: 128 gate/up rows or 256 down rows a block share each staged token tile, so the activations
// cross L2 half as often as with 4, and a tile holds up to 64 tokens (a weight is read once per 64 tokens).

#define FOLD_WARPS 8

// d = a * b on two fp16 lanes, rounded to nearest (exact here: see above).
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// Whether scale byte e lies in the folding window [104, 128].
__device__ __forceinline__ bool fold_in(u32 e) { return e - 104u <= 24u; }

// Both fp16 lanes = 2^(e - 113), for e in the folding window (biased exponent e - 98 in 6 .. 30).
__device__ __forceinline__ u32 fold_factor(u32 e) { return ((e - 98u) << 10) * 0x00010001u; }

// d = A . B + 0 for one m16n8k16 tile.
__device__ __forceinline__ void mma16816_zero(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.f));
}

// One batch (four groups) of the folded GEMM (`moe_gemm_impl` with FOLD), group by group: every n-tile's mmas of a
// group, the folded groups' sums gathered in `tmp` for the whole batch.
template <int NT>
__device__ __forceinline__ void fold_batch_q(const u32 w[2][2][4], const u32 e[2][2], const uint4* xb, int g,
                                             int hi_u, int lo_u, float acc[2][NT][4]) {
    // This batch's sums of the folded groups.
    float tmp[2][NT][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) tmp[i][j][k] = 0.f;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        u32 h[2][2][4], ee[2][2];
        bool in = true;
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                decode_h2(w[i][r][q], h[i][r]);
                ee[i][r] = (e[i][r] >> (8 * q)) & 0xffu;
                in = in && fold_in(ee[i][r]);
            }
        const uint4* tq = xb + q * NT * 8 * 8;
        if (__all_sync(FULL_MASK, in)) {
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const u32 f = fold_factor(ee[i][r]);
#pragma unroll
                    for (int k = 0; k < 4; k++) h[i][r][k] = hmul2(h[i][r][k], f);
                }
            // Two n-tiles at a time, each step's four mmas independent (four chains of four), so one mma's
            // latency hides behind the next ones.
#pragma unroll
            for (int j0 = 0; j0 < NT; j0 += 2) {
                uint4 bx[2][2];
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    const uint4* tb = tq + (8 * (j0 + u) + g) * 8;
                    bx[u][0] = tb[hi_u];
                    bx[u][1] = tb[lo_u];
                }
#pragma unroll
                for (int step = 0; step < 4; step++) {
                    const int half = step & 1, lo = step >> 1;
#pragma unroll
                    for (int u = 0; u < 2; u++)
#pragma unroll
                        for (int i = 0; i < 2; i++) {
                            const uint4 bv = bx[u][lo];
                            mma16816(tmp[i][j0 + u], h[i][0][2 * half], h[i][1][2 * half], h[i][0][2 * half + 1],
                                     h[i][1][2 * half + 1], half ? bv.z : bv.x, half ? bv.w : bv.y);
                        }
                }
            }
        } else {
            float sc[2][2];
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int r = 0; r < 2; r++) sc[i][r] = e8m0(ee[i][r]);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const uint4* tb = tq + (8 * j + g) * 8;
                const uint4 bh = tb[hi_u], bl = tb[lo_u];
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    float d[4];
                    mma16816_zero(d, h[i][0][0], h[i][1][0], h[i][0][1], h[i][1][1], bh.x, bh.y);
                    mma16816(d, h[i][0][2], h[i][1][2], h[i][0][3], h[i][1][3], bh.z, bh.w);
                    mma16816(d, h[i][0][0], h[i][1][0], h[i][0][1], h[i][1][1], bl.x, bl.y);
                    mma16816(d, h[i][0][2], h[i][1][2], h[i][0][3], h[i][1][3], bl.z, bl.w);
#pragma unroll
                    for (int k = 0; k < 4; k++)
                        acc[i][j][k] = fmaf(d[k] * 16384.f, sc[i][k >> 1], acc[i][j][k]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) acc[i][j][k] += tmp[i][j][k];
}

// A GEMM block's shape for this lane: output rows and groups of the input, and the warp's first row (16 rows of gate
// and of up a warp, or 32 of down), from blocks of WARPS warps.
struct GemmGeom {
    int nrows, groups, rowbytes, g, c, row0;
};

template <bool GATE_UP, int WARPS>
__device__ __forceinline__ GemmGeom gemm_geom(int width, int inter) {
    const int cols = GATE_UP ? width : inter;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    return {GATE_UP ? inter : width, cols / GROUP, cols / 2, lane >> 2, lane & 3,
            (int)(blockIdx.x * WARPS + warp) * (GATE_UP ? 16 : 32)};
}

// The next batch's weight and scale words become the current ones.
__device__ __forceinline__ void gemm_rotate(u32 w[2][2][4], u32 e[2][2], const u32 wn[2][2][4],
                                            const u32 en[2][2]) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            e[i][r] = en[i][r];
#pragma unroll
            for (int q = 0; q < 4; q++) w[i][r][q] = wn[i][r][q];
        }
}

// The GEMM kernels' two row streams of a warp: gate/up = (W1, W3) on rows row0 .. row0 + 16; down = W2 on
// row0 .. + 16 and row0 + 16 .. + 32. Lane (g, c) reads word c of rows g and g + 8 of each; rows past the end read
// the last row and are not stored.
template <bool GATE_UP>
__device__ __forceinline__ void gemm_streams(const ExpertSlot& s, int row0, int g, int c, int nrows, int rowbytes,
                                             int groups, const u32* wp[2][2], const u32* sp[2][2]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const u8* mat = (const u8*)(GATE_UP ? (i ? s.w3 : s.w1) : s.w2);
        const u8* sc = (const u8*)(GATE_UP ? (i ? s.s3 : s.s1) : s.s2);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            size_t row = (size_t)min(row0 + (GATE_UP ? 0 : 16 * i) + g + 8 * r, nrows - 1);
            wp[i][r] = (const u32*)(mat + row * rowbytes) + c;
            sp[i][r] = (const u32*)(sc + row * groups);
        }
    }
}

// The split-input rows of a token tile (t0 .. t0 + 8 NT of slot s; tokens past `count` repeat the last one): x
// rows through pair_row for gate/up, pairs for down. Ends with a barrier.
template <int NT, bool GATE_UP>
__device__ __forceinline__ void gemm_tile_rows(const ExpertSlot& s, int t0, int count, const int* pair_row,
                                               int* rows_sm) {
    for (int t = threadIdx.x; t < NT * 8; t += blockDim.x) {
        int p = s.pair0 + t0 + min(t, count - 1);
        rows_sm[t] = GATE_UP ? pair_row[p] : p;
    }
    __syncthreads();
}

// Stores a warp's sums, each times `scale` and its token's sdown factor: the activation of gate and up into
// act (gate/up), or both streams' rows into y (down). Accumulator k of n-tile j: row g + 8 (k >> 1), token
// 8j + 2c + (k & 1).
template <int NT, bool GATE_UP>
__device__ __forceinline__ void gemm_store(const float acc[2][NT][4], float scale, const ExpertSlot& s, int t0,
                                           int count, const int* rows_sm, const float* sdown, float* dst, int row0,
                                           int g, int c, int width, int inter, int act_kind, float beta,
                                           float lin_beta) {
    const int nrows = GATE_UP ? inter : width;
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int t = 8 * j + 2 * c + (k & 1);
            if (t >= count) continue;
            int p = s.pair0 + t0 + t;
            float sd = sdown[rows_sm[t]] * scale;
            int row = row0 + g + 8 * (k >> 1);
            if (GATE_UP) {
                if (row < nrows)
                    dst[(size_t)p * inter + row] = glu(act_kind, beta, lin_beta, acc[0][j][k] * sd, acc[1][j][k] * sd);
            } else {
#pragma unroll
                for (int i = 0; i < 2; i++)
                    if (row + 16 * i < nrows) dst[(size_t)p * width + row + 16 * i] = acc[i][j][k] * sd;
            }
        }
}

// Word c of a group's hi (or lo) half from `moe_split_hilo_k`'s layout (the four units hold component s of words
// 0..3), in `moe_split_hilo`'s form: its components 0..3.
__device__ __forceinline__ uint4 kmaj_word(const uint4* units, int c) {
    const u32* p = (const u32*)units + c;
    return make_uint4(__ldg(p), __ldg(p + 4), __ldg(p + 8), __ldg(p + 12));
}

// GATE_UP: act[pair] = glu(W1 x, W3 x); otherwise y[pair] = W2 act[pair]. `frag`/`sdown` hold the split input
// rows (x rows for gate/up, indexed through pair_row; pairs for down). Needs cols a multiple of 128. SMEM_B: the B
// fragments go through shared memory (cp.async, double-buffered per batch of four groups, shared by the block's
// warps) instead of being loaded by every warp through L1. Every n-tile is computed (tokens past the tile's end
// repeat its last token and are not stored), so the loops have no data-dependent branches and the mmas of all
// n-tiles interleave. Blocks of WARPS warps; FOLD: each batch through `fold_batch_q` (the folded GEMM above).
template <int NT, bool GATE_UP, bool SMEM_B, int WARPS = GEMM_WARPS, bool FOLD = false, bool KMAJ = false>
__device__ void moe_gemm_impl(const SlotTable& tab, const int* pair_row, const uint4* frag, const float* sdown,
                              float* dst, int width, int inter, int act_kind, float beta, float lin_beta) {
    static_assert(SMEM_B || !FOLD, "the folded batches read B from shared memory");
    static_assert(!(SMEM_B && KMAJ), "k-major input rows are read through L1");
    extern __shared__ uint4 bsm[];
    __shared__ int rows_sm[NT * 8];
    const ExpertSlot& s = tab.s[blockIdx.y];
    const int t0 = blockIdx.z * NT * 8;
    if (t0 >= s.n_rows) return;
    const int count = min(NT * 8, s.n_rows - t0);
    const auto [nrows, groups, rowbytes, g, c, row0] = gemm_geom<GATE_UP, WARPS>(width, inter);

    const u32* wp[2][2];
    const u32* sp[2][2];
    gemm_streams<GATE_UP>(s, row0, g, c, nrows, rowbytes, groups, wp, sp);
    gemm_tile_rows<NT, GATE_UP>(s, t0, count, pair_row, rows_sm);
    const uint4* bp[NT];
    if (!SMEM_B) {
#pragma unroll
        for (int j = 0; j < NT; j++) bp[j] = frag + (size_t)rows_sm[8 * j + g] * groups * 8 + (KMAJ ? 0 : c);
    }
    // In shared memory, lane (g, c) finds its hi word at unit c (even g) or 4 + c (odd g), and lo at the other.
    const int hi_u = c + 4 * (g & 1), lo_u = c + 4 * (1 - (g & 1));

    float acc[2][NT][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) acc[i][j][k] = 0.f;

    const int nb = groups / 4;
    constexpr int BUF = NT * 8 * 32; // uint4 per shared-memory buffer
    if (SMEM_B) gemm_stage_b<NT, WARPS * WARP>(bsm, frag, rows_sm, groups, 0);
    u32 w[2][2][4], e[2][2];
    gemm_load(wp, sp, 0, w, e);
    for (int b = 0; b < nb; b++) {
        u32 wn[2][2][4], en[2][2];
        gemm_load(wp, sp, b + 1 < nb ? b + 1 : b, wn, en);
        const uint4* xb = bsm + (b & 1) * BUF;
        if (SMEM_B) {
            if (b + 1 < nb) {
                gemm_stage_b<NT, WARPS * WARP>(bsm + ((b + 1) & 1) * BUF, frag, rows_sm, groups, b + 1);
                cp_async_wait<1>();
            } else {
                cp_async_wait_all();
            }
            __syncthreads();
        }
        if (FOLD) {
            fold_batch_q<NT>(w, e, xb, g, hi_u, lo_u, acc);
        } else {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int grp = 4 * b + q;
                u32 h[2][2][4];
                float sc[2][2];
#pragma unroll
                for (int i = 0; i < 2; i++)
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        decode_h2(w[i][r][q], h[i][r]);
                        sc[i][r] = e8m0((e[i][r] >> (8 * q)) & 0xffu);
                    }
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    uint4 bh, bl;
                    if (SMEM_B) {
                        const uint4* tb = xb + (q * NT * 8 + 8 * j + g) * 8;
                        bh = tb[hi_u];
                        bl = tb[lo_u];
                    } else if (KMAJ) {
                        bh = kmaj_word(bp[j] + grp * 8, c);
                        bl = kmaj_word(bp[j] + grp * 8 + 4, c);
                    } else {
                        bh = __ldg(bp[j] + grp * 8);
                        bl = __ldg(bp[j] + grp * 8 + 4);
                    }
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        float dh[4] = {0.f, 0.f, 0.f, 0.f}, dl[4] = {0.f, 0.f, 0.f, 0.f};
                        mma16816(dh, h[i][0][0], h[i][1][0], h[i][0][1], h[i][1][1], bh.x, bh.y);
                        mma16816(dl, h[i][0][0], h[i][1][0], h[i][0][1], h[i][1][1], bl.x, bl.y);
                        mma16816(dh, h[i][0][2], h[i][1][2], h[i][0][3], h[i][1][3], bh.z, bh.w);
                        mma16816(dl, h[i][0][2], h[i][1][2], h[i][0][3], h[i][1][3], bl.z, bl.w);
                        acc[i][j][0] = fmaf(sc[i][0], dh[0] + dl[0], acc[i][j][0]);
                        acc[i][j][1] = fmaf(sc[i][0], dh[1] + dl[1], acc[i][j][1]);
                        acc[i][j][2] = fmaf(sc[i][1], dh[2] + dl[2], acc[i][j][2]);
                        acc[i][j][3] = fmaf(sc[i][1], dh[3] + dl[3], acc[i][j][3]);
                    }
                }
            }
        }
        if (SMEM_B) __syncthreads(); // every warp is done with this buffer before it is refilled
        gemm_rotate(w, e, wn, en);
    }

    // Folded sums are w.x * 2^s_t: 2^(14 - s_t) * 2^-14 = 2^-s_t, a normal float for every s_t hilo_factors gives.
    gemm_store<NT, GATE_UP>(acc, FOLD ? 1.f / 16384.f : 1.f, s, t0, count, rows_sm, sdown, dst, row0, g, c, width,
                            inter, act_kind, beta, lin_beta);
}

// Entry points moe_gemm_{gate_up,down}_n<NT><SUFFIX>: NT n-tiles of 8 tokens; SUFFIX _s: B through shared memory.
#define MOE_GEMM_ENTRY(NT, SMEM_B, SUFFIX, MINB)                                                                \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, MINB) moe_gemm_gate_up_n##NT##SUFFIX(            \
        const __grid_constant__ SlotTable tab, const int* pair_row, const uint4* frag, const float* sdown,      \
        float* act, int width, int inter, int act_kind, float beta, float lin_beta) {                           \
        moe_gemm_impl<NT, true, SMEM_B>(tab, pair_row, frag, sdown, act, width, inter, act_kind, beta,          \
                                        lin_beta);                                                              \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, MINB)                                            \
        moe_gemm_down_n##NT##SUFFIX(const __grid_constant__ SlotTable tab, const uint4* frag,                  \
                                    const float* sdown, float* y, int width, int inter) {                      \
        moe_gemm_impl<NT, false, SMEM_B>(tab, 0, frag, sdown, y, width, inter, 0, 1.f, 1.f);                    \
    }

// (MINB: blocks per multiprocessor the register allocation must allow; two for eight n-tiles, whose 64
// accumulators and staged operands need more than 168 registers.)
MOE_GEMM_ENTRY(1, false, , 3)
MOE_GEMM_ENTRY(2, false, , 3)
MOE_GEMM_ENTRY(4, false, , 3)
MOE_GEMM_ENTRY(8, false, , 2)
MOE_GEMM_ENTRY(1, true, _s, 3)
MOE_GEMM_ENTRY(2, true, _s, 3)
MOE_GEMM_ENTRY(4, true, _s, 3)
MOE_GEMM_ENTRY(8, true, _s, 2)

// Entry points moe_fold_{gate_up,down}_n<NT>: NT n-tiles of 8 tokens, blocks of 8 warps, one a multiprocessor (the
// running sums, batch sums and staged operands take up to 255 registers). Blocks of 4 warps, two a multiprocessor,
// measured the same at 32-128 tokens (docs/performance-log.md).
#define MOE_FOLD_ENTRY(NT)                                                                                      \
    extern "C" __global__ void __launch_bounds__(FOLD_WARPS * WARP, 1) moe_fold_gate_up_n##NT(                  \
        const __grid_constant__ SlotTable tab, const int* pair_row, const uint4* frag, const float* sdown,      \
        float* act, int width, int inter, int act_kind, float beta, float lin_beta) {                           \
        moe_gemm_impl<NT, true, true, FOLD_WARPS, true>(tab, pair_row, frag, sdown, act, width, inter, act_kind,  \
                                                        beta, lin_beta);                                        \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(FOLD_WARPS * WARP, 1)                                          \
        moe_fold_down_n##NT(const __grid_constant__ SlotTable tab, const uint4* frag, const float* sdown,       \
                            float* y, int width, int inter) {                                                   \
        moe_gemm_impl<NT, false, true, FOLD_WARPS, true>(tab, 0, frag, sdown, y, width, inter, 0, 1.f, 1.f);     \
    }

MOE_FOLD_ENTRY(4)
MOE_FOLD_ENTRY(8)

// ---------------------------------------------------------------------------------------------------------------
// The folded GEMM on Hopper's warpgroup mmas (`moe_wg_*`, compiled for sm_90a; the same blocks as `moe_fold_*`:
// 256 threads, 128 gate/up rows or 256 down rows, one token tile of up to 64 tokens).
//
// Each warpgroup owns 64 rows of two streams (gate/up: rows r .. r + 64 of W1 and of W3; down: two consecutive
// 64-row tiles of W2) and multiplies them by all 64 tokens with `wgmma.mma_async.m64n64k16` (A, the folded fp16
// weights, from registers in mma.sync's fragment layout: lane (g, c) of warp w holds word c of rows 16w + g and
// 16w + g + 8; B, one k-tile of the tokens' hi or lo halves, from shared memory). Per FLUSH batches of four groups
// (one, or two in the `_f2` kernels) the wgmmas of a stream chain into batch sums that start from zero (as
// `fold_batch_q`), added into the f32 running sums once those wgmmas are done. The `moe_wgw_*` kernels (WIDE) take a
// k-tile's hi and lo halves in one `m64n128k16` instead (B: the 64 tokens' hi rows, then their lo rows; batch sums
// of 64 f32 a stream, the hi and lo sums of an output added together into its running sum), and come in 32-token
// tiles too (`_n4`: one `m64n64k16`, the ring's B tiles half as large).
//
// Pipelining: weights (16-byte group chunks, copied by the quad's four lanes) and scale words go through a ring of
// WG_STAGES batches in shared memory beside the tokens' B tiles, WG_STAGES - 2 batches ahead (the slot refilled is
// that of two batches back, which no wgmma reads any more); one barrier a batch. Each group's A fragments are
// decoded while the previous group's wgmmas run (two register slots, `wgmma.wait_group 1` before a slot is reused),
// across the batches of a chain too; a chain's last batch ends with all its wgmmas done.
//
// B tiles: per batch and half (hi, lo: 16 KB each) the 64 tokens' 128 k (eight k-tiles of 16: k-tile 2q + t is k-tile
// t of group q) in the 128-byte swizzled K-major layout, which the tensor cores read without the bank conflicts of the
// unswizzled one: two atom columns of 64 k (16 KB; `wg_b_column`), each eight 1 KB atoms of 8 tokens' hi halves and
// then eight of their lo halves, token n's 128-byte row of a half at (n / 8) * 1024 + (n % 8) * 128 holding 16-byte
// chunk j (k block j / 2, half j % 2) at ((j ^ (n % 8)) * 16). The k order is mma.sync's (k slots 2c, 2c + 1 of
// k-tile t, half 0 hold elements (0, 4) of word c for t = 0 and (1, 5) for t = 1; half 1 (2, 6) and (3, 7)), so a
// 16-byte chunk is one component of the group's four words: `moe_split_hilo_k` writes exactly those chunks.
//
// A block whose rows have a scale outside the folding window anywhere runs `moe_gemm_impl` (the mma.sync folded
// GEMM with its per-group fallback) instead: a barrier-wide vote over the block's scale bytes before the loop.

#define WG_STAGES 4
// Bytes of a batch's B tiles for a tile of NT n-tiles (8 NT tokens): 8 NT tokens x 128 k x hi/lo x 2 bytes.
template <int NT>
__device__ __forceinline__ constexpr u32 wg_b_bytes() { return NT * 4096; }

// Bytes from a ring slot's B tiles to the atom column holding k-tile kt (0..8) of half hl (0: hi, 1: lo): the hi
// and lo atoms of an atom column (NT of 1 KB each) lie next to each other, so that one descriptor of 16 NT rows reads
// both.
template <int NT>
__device__ __forceinline__ u32 wg_b_column(int hl, int kt) { return (kt >> 2) * (NT * 2048) + hl * (NT * 1024); }
// Bytes per quad and stage of the weight ring: 4 stream rows x 4 group chunks of 16 bytes, 4 scale words, padded
// so that the eight quads of a warp read distinct banks.
#define WG_QUAD_BYTES 272
#define WG_W_BYTES (FOLD_WARPS * 8 * WG_QUAD_BYTES)

// The split input rows of the warpgroup GEMM: frag[row][group] = 8 uint4, [hi, lo][component s] = component s of
// the group's four words (each word's halves in the order (0, 4, 2, 6, 1, 5, 3, 7), as `moe_split_hilo`).
extern "C" __global__ void moe_split_hilo_k(const float* src, int cols, float* sdown, uint4* frag) {
    const int row = blockIdx.x;
    const float* x = src + (size_t)row * cols;
    const float f = split_factor(x, cols, &sdown[row]);
    uint4* out = frag + (size_t)row * (cols / GROUP) * 8;
    for (int grp = threadIdx.x; grp < cols / GROUP; grp += blockDim.x) {
        u32 hw[4][4], lw[4][4]; // [word][component]
#pragma unroll
        for (int c = 0; c < 4; c++) split_word(x + (size_t)grp * GROUP + 8 * c, f, hw[c], lw[c]);
#pragma unroll
        for (int s = 0; s < 4; s++) {
            out[grp * 8 + s] = make_uint4(hw[0][s], hw[1][s], hw[2][s], hw[3][s]);
            out[grp * 8 + 4 + s] = make_uint4(lw[0][s], lw[1][s], lw[2][s], lw[3][s]);
        }
    }
}

// Whether every scale byte of rows [lo, hi) of a [rows, groups] scale matrix lies in the folding window, for
// this thread's share of the words (groups is a multiple of 4).
__device__ __forceinline__ bool wg_scales_fold(const u8* sc, int lo, int hi, int groups) {
    const u32* w = (const u32*)(sc + (size_t)lo * groups);
    const int n = (hi - lo) * groups / 4;
    bool ok = true;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ok = ok && __vcmpleu4(__vsub4(__ldg(w + i), 0x68686868u),
                                                                           0x18181818u) == 0xffffffffu;
    return ok;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// The descriptor of a 64-token B tile at shared address `a` in the 128-byte swizzled K-major layout: 8-token atoms
// 1 KB apart (stride offset), the leading offset unused; `a` lies in a 1 KB-aligned atom column, 32 bytes a k block
// into it.
__device__ __forceinline__ unsigned long long wg_desc(u32 a) {
    return (unsigned long long)((a & 0x3ffffu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

// d = A . B (+ d when `acc`) for one m64n64k16 tile; A from registers (this warp's 16 rows), B at descriptor `b`.
__device__ __forceinline__ void wgmma_rs(float d[32], u32 a0, u32 a1, u32 a2, u32 a3, unsigned long long b,
                                         int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
                   "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
                   "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(acc));
}

// d = A . B (+ d when `acc`) for one m64n128k16 tile: the 64 tokens' hi halves (d[0..32]) and lo halves (d[32..64]).
__device__ __forceinline__ void wgmma_rs128(float d[64], u32 a0, u32 a1, u32 a2, u32 a3, unsigned long long b,
                                            int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
                   "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
                   "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
                   "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
                   "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
                   "+f"(d[63])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(acc));
}

// Queues batch b's copies into ring slot `slot`: the block's B tiles (64 tokens x 4 groups x 8 chunks), and this
// lane's weight chunk (group 4b + c of each of its four stream rows) and scale word (stream row c). A warp's copy
// instruction takes four chunks (64 bytes) of eight tokens, each eight lanes one chunk of the eight: whole sectors
// from global memory, eight distinct bank quads in shared memory (token n's chunk j lands in quad j ^ n % 8).
// Copy `it` (0..8) of thread (warp w, lane l) moves chunk k8 = ((l >> 3) & 3) | ((w & 1) << 2) of group 4b + q, q =
// (w >> 1) & 3, of token 8 it + (l & 7) (the B tiles' layout: above): `WgCopies` holds what of that does not change
// from batch to batch.
struct WgCopies {
    const uint4* src; // frag + q * 8 + k8: add the token's row times `rstride` and 32 b
    const int* rows;  // rows_sm + (l & 7): the tile's token rows, 8 it further for copy it
    size_t rstride;   // uint4 a frag row: groups * 8
    u32 dst;          // bytes into a ring slot's B tiles for copy 0; copy it lies 1 KB (one atom) further
};

template <int NT>
__device__ __forceinline__ WgCopies wg_copies(const uint4* frag, const int* rows, int groups) {
    static_assert(FOLD_WARPS == 8, "a copy's token is 8 it + (l & 7) with eight warps");
    const int l = threadIdx.x & 31, w = threadIdx.x >> 5, r = l & 7;
    const int q = (w >> 1) & 3, k8 = ((l >> 3) & 3) | ((w & 1) << 2), hl = k8 >> 2, s = k8 & 3;
    // k-tile 2q + (s >> 1) of the batch: atom column kt >> 2, k block kt & 3 in it; chunk j of the token's row.
    const int kt = 2 * q + (s >> 1), j = 2 * (kt & 3) + (s & 1);
    return WgCopies{frag + q * 8 + k8, rows + r, (size_t)groups * 8,
                    wg_b_column<NT>(hl, kt) + r * 128 + ((j ^ r) << 4)};
}

template <int NT>
__device__ __forceinline__ void wg_stage(u32 bsm, u32 wsm, const WgCopies& cp, int b, const u8* const wrow[4],
                                         const u8* srow, int c) {
#pragma unroll
    for (int it = 0; it < NT; it++)
        cp_async16<false>(bsm + cp.dst + it * 1024, cp.src + cp.rows[8 * it] * cp.rstride + 32 * b, 16);
#pragma unroll
    for (int k = 0; k < 4; k++) cp_async16<true>(wsm + (k * 4 + c) * 16, wrow[k] + (4 * b + c) * 16, 16);
    cp_async4(wsm + 256 + 4 * c, srow + 4 * b, 4);
    cp_async_commit();
}

template <bool GATE_UP, int FLUSH, bool WIDE, int NT>
__device__ void moe_wg_main(const ExpertSlot& s, const int* rows_sm, const uint4* frag, const float* sdown,
                            float* dst, int width, int inter, int t0, int count, int act_kind, float beta,
                            float lin_beta) {
    extern __shared__ uint4 bsm[];
    const int cols = GATE_UP ? width : inter, nrows = GATE_UP ? inter : width;
    const int groups = cols / GROUP, rowbytes = cols / 2, nb = groups / 4;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1), g = lane >> 2, c = lane & 3;
    const int wg = warp >> 2, wi = warp & 3;
    // First row of stream 0 of this warp; stream 1 is the other matrix (gate/up) or 64 rows further (down).
    const int row0 = blockIdx.x * (GATE_UP ? 128 : 256) + wg * (GATE_UP ? 64 : 128) + 16 * wi;
    const u8* wrow[4]; // stream row k = 2 i + r: stream i, row g + 8 r
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int i = k >> 1, r = k & 1;
        const u8* mat = (const u8*)(GATE_UP ? (i ? s.w3 : s.w1) : s.w2);
        wrow[k] = mat + (size_t)min(row0 + (GATE_UP ? 0 : 64 * i) + g + 8 * r, nrows - 1) * rowbytes;
    }
    const u8* srow;
    {
        const int i = c >> 1, r = c & 1;
        const u8* sc = (const u8*)(GATE_UP ? (i ? s.s3 : s.s1) : s.s2);
        srow = sc + (size_t)min(row0 + (GATE_UP ? 0 : 64 * i) + g + 8 * r, nrows - 1) * groups;
    }
    // The B tiles' atoms are 1 KB-aligned (the swizzle pattern repeats every 1 KB of shared addresses).
    const u32 b_base = (smem_addr(bsm) + 1023u) & ~1023u;
    static_assert(WIDE ? NT == 8 || NT == 4 : NT == 8, "wide tiles of 64 or 32 tokens, the two-wgmma form 64");
    constexpr u32 B_STAGE = wg_b_bytes<NT>(), W_STAGE = WG_W_BYTES;
    const u32 w_base = b_base + WG_STAGES * B_STAGE + (warp * 8 + g) * WG_QUAD_BYTES;
    const WgCopies copies = wg_copies<NT>(frag, rows_sm, groups);
#pragma unroll
    for (int st = 0; st < WG_STAGES - 2; st++) {
        if (st < nb)
            wg_stage<NT>(b_base + st * B_STAGE, w_base + st * W_STAGE, copies, st, wrow, srow, c);
        else
            cp_async_commit();
    }

    // Four sums a thread per n-tile and stream (NACC). WIDE: one wgmma of 16 NT columns takes the hi and the lo halves
    // (tmp[i][k], tmp[i][NACC + k]: the same output).
    constexpr int NACC = 4 * NT, NTMP = WIDE ? 2 * NACC : NACC;
    float acc[2][NACC], tmp[2][NTMP];
#pragma unroll
    for (int i = 0; i < 2; i++) {
#pragma unroll
        for (int k = 0; k < NACC; k++) acc[i][k] = 0.f;
#pragma unroll
        for (int k = 0; k < NTMP; k++) tmp[i][k] = 0.f;
    }

    // FLUSH batches a round (nb a multiple of FLUSH: the host's choice), unrolled, so that the last batch's wait
    // for all its wgmmas is no branch (ptxas serialises the wgmmas of a kernel that waits in a divergent path).
    for (int b0 = 0; b0 < nb; b0 += FLUSH)
#pragma unroll
    for (int u = 0; u < FLUSH; u++) {
        const int b = b0 + u;
        const int slot = b % WG_STAGES;
        cp_async_wait<WG_STAGES - 3>();
        fence_proxy_async();
        // Batch b's copies are visible to all, and every warpgroup is done with batch b - 2's slot (a batch ends
        // with at most its last group's wgmmas in flight).
        __syncthreads();
        const int nxt = b + WG_STAGES - 2;
        if (nxt < nb)
            wg_stage<NT>(b_base + (nxt % WG_STAGES) * B_STAGE, w_base + (nxt % WG_STAGES) * W_STAGE, copies, nxt,
                         wrow, srow, c);
        else
            cp_async_commit();
        const u32 bs = b_base + slot * B_STAGE, ws = w_base + slot * W_STAGE;
        // The slot's first B tile; tile (q, t, hl) at its half, atom column and k block (the descriptor's address
        // field counts 16-byte units and stays below its 2^14 limit in shared memory).
        const unsigned long long bdesc = wg_desc(bs);
        u32 e4[4];
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(e4[0]), "=r"(e4[1]), "=r"(e4[2]), "=r"(e4[3])
                     : "r"(ws + 256));
        u32 a[2][2][8]; // [slot][stream][k-tile 0: a0..a3, k-tile 1: a0..a3]
#pragma unroll
        for (int q = 0; q < 4; q++) {
            if (q >= 1) wg_wait<1>(); // the wgmmas that read slot q & 1 (group q - 2, or the last batch's) are done
            u32(&aq)[2][8] = a[q & 1];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                u32 h[2][4];
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    u32 wv;
                    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(wv) : "r"(ws + ((2 * i + r) * 4 + q) * 16 + 4 * c));
                    decode_h2(wv, h[r]);
                    const u32 f = fold_factor((e4[2 * i + r] >> (8 * q)) & 0xffu);
#pragma unroll
                    for (int k = 0; k < 4; k++) h[r][k] = hmul2(h[r][k], f);
                }
#pragma unroll
                for (int t = 0; t < 2; t++) {
                    aq[i][4 * t + 0] = h[0][2 * t];
                    aq[i][4 * t + 1] = h[1][2 * t];
                    aq[i][4 * t + 2] = h[0][2 * t + 1];
                    aq[i][4 * t + 3] = h[1][2 * t + 1];
                }
            }
            wg_fence();
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int t = 0; t < 2; t++) {
                    const int kt = 2 * q + t;
                    // The descriptor of k-tile kt's hi tile (hl 0; a wide wgmma reads the lo one after it) or lo tile.
                    const auto desc = [&](int hl) { return bdesc + (wg_b_column<NT>(hl, kt) + (kt & 3) * 32) / 16; };
                    const u32* ak = &aq[i][4 * t]; // this k-tile's A fragment
                    if constexpr (WIDE && NT == 8) {
                        wgmma_rs128(tmp[i], ak[0], ak[1], ak[2], ak[3], desc(0), u + q + t > 0);
                    } else if constexpr (WIDE) {
                        wgmma_rs(tmp[i], ak[0], ak[1], ak[2], ak[3], desc(0), u + q + t > 0);
                    } else {
#pragma unroll
                        for (int hl = 0; hl < 2; hl++)
                            wgmma_rs(tmp[i], ak[0], ak[1], ak[2], ak[3], desc(hl), u + q + t + hl > 0);
                    }
                }
            wg_commit();
        }
        // The round's sums are added into the running sums once its wgmmas are done.
        if (u == FLUSH - 1) {
            wg_wait<0>();
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int k = 0; k < NACC; k++) acc[i][k] += WIDE ? tmp[i][k] + tmp[i][k + NTMP - NACC] : tmp[i][k];
        } else {
            wg_wait<1>(); // group 2 done: slot 0 is free for the next batch's group 0
        }
    }
    cp_async_wait_all();

    // Accumulator 4j + k of stream i: row row0 (+ 64 i for down) + g + 8 (k >> 1), token 8j + 2c + (k & 1).
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int t = 8 * j + 2 * c + (k & 1);
            if (t >= count) continue;
            int p = s.pair0 + t0 + t;
            float sd = sdown[rows_sm[t]] * (1.f / 16384.f);
            int row = row0 + g + 8 * (k >> 1);
            if (GATE_UP) {
                if (row < nrows)
                    dst[(size_t)p * inter + row] =
                        glu(act_kind, beta, lin_beta, acc[0][4 * j + k] * sd, acc[1][4 * j + k] * sd);
            } else {
#pragma unroll
                for (int i = 0; i < 2; i++)
                    if (row + 64 * i < nrows) dst[(size_t)p * width + row + 64 * i] = acc[i][4 * j + k] * sd;
            }
        }
}

#endif

// GATE_UP: act[pair] = glu(W1 x, W3 x); otherwise y[pair] = W2 act[pair]. `frag`/`sdown` hold the input rows split
// by `moe_split_hilo_k`. A block with a scale outside the folding window (and every block where the warpgroup
// mmas do not exist) runs the mma.sync GEMM with per-group scales, its B fragments read from `frag` through L1.
template <bool GATE_UP, int FLUSH, bool WIDE, int NT>
__device__ void moe_wg_impl(const SlotTable& tab, const int* pair_row, const uint4* frag, const float* sdown,
                            float* dst, int width, int inter, int act_kind, float beta, float lin_beta) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ int rows_wg[NT * 8];
    const ExpertSlot& s = tab.s[blockIdx.y];
    const int t0 = blockIdx.z * NT * 8;
    if (t0 >= s.n_rows) return;
    const int count = min(NT * 8, s.n_rows - t0);
    gemm_tile_rows<NT, GATE_UP>(s, t0, count, pair_row, rows_wg);
    const int cols = GATE_UP ? width : inter, nrows = GATE_UP ? inter : width, groups = cols / GROUP;
    const int lo = blockIdx.x * (GATE_UP ? 128 : 256), hi = min(lo + (GATE_UP ? 128 : 256), nrows);
    bool ok = GATE_UP ? wg_scales_fold((const u8*)s.s1, lo, hi, groups) &&
                            wg_scales_fold((const u8*)s.s3, lo, hi, groups)
                      : wg_scales_fold((const u8*)s.s2, lo, hi, groups);
    if (__syncthreads_and(ok)) {
        moe_wg_main<GATE_UP, FLUSH, WIDE, NT>(s, rows_wg, frag, sdown, dst, width, inter, t0, count, act_kind, beta,
                                              lin_beta);
        return;
    }
#endif
    moe_gemm_impl<NT, GATE_UP, false, FOLD_WARPS, false, true>(tab, pair_row, frag, sdown, dst, width, inter,
                                                               act_kind, beta, lin_beta);
}

// Entry points {moe_wg,moe_wgw}_{gate_up,down}_n<NT><SUFFIX>: 8 NT tokens a block, 8 warps (two warpgroups), one
// block a multiprocessor; batch sums over FLUSH batches of four groups (suffix _f2: two, for inputs whose batch count
// is even).
#define MOE_WG_ENTRY(PREFIX, WIDE, NT, FLUSH, SUFFIX)                                                              \
    extern "C" __global__ void __launch_bounds__(FOLD_WARPS * WARP, 1) PREFIX##_gate_up_n##NT##SUFFIX(             \
        const __grid_constant__ SlotTable tab, const int* pair_row, const uint4* frag, const float* sdown,         \
        float* act, int width, int inter, int act_kind, float beta, float lin_beta) {                              \
        moe_wg_impl<true, FLUSH, WIDE, NT>(tab, pair_row, frag, sdown, act, width, inter, act_kind, beta, lin_beta); \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(FOLD_WARPS * WARP, 1) PREFIX##_down_n##NT##SUFFIX(                \
        const __grid_constant__ SlotTable tab, const uint4* frag, const float* sdown, float* y, int width,          \
        int inter) {                                                                                               \
        moe_wg_impl<false, FLUSH, WIDE, NT>(tab, 0, frag, sdown, y, width, inter, 0, 1.f, 1.f);                    \
    }

MOE_WG_ENTRY(moe_wg, false, 8, 1, )
MOE_WG_ENTRY(moe_wg, false, 8, 2, _f2)
MOE_WG_ENTRY(moe_wgw, true, 8, 1, )
MOE_WG_ENTRY(moe_wgw, true, 8, 2, _f2)
MOE_WG_ENTRY(moe_wgw, true, 4, 1, )
MOE_WG_ENTRY(moe_wgw, true, 4, 2, _f2)
