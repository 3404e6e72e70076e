// Dense linear layers with weights resident on the GPU: y[t, r] = W[r, :] . x[t, :] for W [rows, cols] in f32 or
// bf16 (raw bits) and x [T, cols] in f32. A warp owns DENSE_ROWS_PER_WARP rows; lanes read 16 bytes of a row at a
// time, coalesced, and the matching activations straight from global memory (small and L1-resident). Tokens are
// processed in tiles of DENSE_TT, so a weight row is read once per tile. Requires cols % 4 == 0 (f32) or
// cols % 8 == 0 (bf16); the Rust side keeps other shapes on the CPU.

#define DENSE_WARPS 8
#define DENSE_ROWS_PER_WARP 2
#define DENSE_TT 8

__device__ __forceinline__ float bf16_lo(u32 v) { return __int_as_float((int)(v << 16)); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __int_as_float((int)(v & 0xffff0000u)); }

template <bool BF16>
__device__ void dense_gemm_impl(const void* w, const float* x, float* y, int rows, int cols, int n_tok) {
    int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    int row0 = (blockIdx.x * DENSE_WARPS + warp) * DENSE_ROWS_PER_WARP;
    for (int r = 0; r < DENSE_ROWS_PER_WARP; r++) {
        int row = row0 + r;
        if (row >= rows) return;
        for (int t0 = 0; t0 < n_tok; t0 += DENSE_TT) {
            int count = min(DENSE_TT, n_tok - t0);
            float acc[DENSE_TT];
#pragma unroll
            for (int t = 0; t < DENSE_TT; t++) acc[t] = 0.f;
            if (BF16) {
                const uint4* wr = (const uint4*)((const u16*)w + (size_t)row * cols);
                int n8 = cols / 8;
                for (int i = lane; i < n8; i += WARP) {
                    uint4 p = __ldg(wr + i);
                    float wv[8] = {bf16_lo(p.x), bf16_hi(p.x), bf16_lo(p.y), bf16_hi(p.y),
                                   bf16_lo(p.z), bf16_hi(p.z), bf16_lo(p.w), bf16_hi(p.w)};
#pragma unroll
                    for (int t = 0; t < DENSE_TT; t++) {
                        if (t < count) {
                            const float4* xr = (const float4*)(x + (size_t)(t0 + t) * cols) + 2 * i;
                            float4 a = __ldg(xr), b = __ldg(xr + 1);
                            float s = acc[t];
                            s = fmaf(wv[0], a.x, s);
                            s = fmaf(wv[1], a.y, s);
                            s = fmaf(wv[2], a.z, s);
                            s = fmaf(wv[3], a.w, s);
                            s = fmaf(wv[4], b.x, s);
                            s = fmaf(wv[5], b.y, s);
                            s = fmaf(wv[6], b.z, s);
                            s = fmaf(wv[7], b.w, s);
                            acc[t] = s;
                        }
                    }
                }
            } else {
                const float4* wr = (const float4*)((const float*)w + (size_t)row * cols);
                int n4 = cols / 4;
                for (int i = lane; i < n4; i += WARP) {
                    float4 p = __ldg(wr + i);
#pragma unroll
                    for (int t = 0; t < DENSE_TT; t++) {
                        if (t < count) {
                            float4 a = __ldg((const float4*)(x + (size_t)(t0 + t) * cols) + i);
                            float s = acc[t];
                            s = fmaf(p.x, a.x, s);
                            s = fmaf(p.y, a.y, s);
                            s = fmaf(p.z, a.z, s);
                            s = fmaf(p.w, a.w, s);
                            acc[t] = s;
                        }
                    }
                }
            }
#pragma unroll
            for (int t = 0; t < DENSE_TT; t++) {
                float v = warp_sum(acc[t]);
                if (lane == 0 && t < count) y[(size_t)(t0 + t) * rows + row] = v;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(DENSE_WARPS * WARP)
    dense_gemm_f32(const float* w, const float* x, float* y, int rows, int cols, int n_tok) {
    dense_gemm_impl<false>(w, x, y, rows, cols, n_tok);
}

extern "C" __global__ void __launch_bounds__(DENSE_WARPS * WARP)
    dense_gemm_bf16(const u16* w, const float* x, float* y, int rows, int cols, int n_tok) {
    dense_gemm_impl<true>(w, x, y, rows, cols, n_tok);
}

// Plain device-to-device copy of n 16-byte words (the bandwidth reference measured in the same run as the MoE
// kernels).
extern "C" __global__ void copy16(const uint4* src, uint4* dst, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}
