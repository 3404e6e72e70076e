// deltafin CUDA kernels: shared definitions. Compiled at run time by NVRTC: the Rust side concatenates this file
// with the other kernels/*.cu sources (no #include), so everything here is plain CUDA C++ without the toolkit's
// headers.
//
// Numbers: every kernel accumulates in f32 and never uses fast-math intrinsics, so results differ from the CPU's
// fixed-order kernels only in summation order.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP 32
#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

// Sum over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Max over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// The gated activation of every MLP in the family, exactly as the CPU's `ops::glu`:
// kind 0 = SiTU: (beta tanh(g / beta) sigma(g)) (lin_beta tanh(u / lin_beta)); kind 1 = SiLU(g) u.
// Kinds 2 and 3 return g or u unchanged: the tests use them to check each MXFP4 product on its own.
__device__ __forceinline__ float glu(int kind, float beta, float lin_beta, float g, float u) {
    if (kind == 0) {
        float a = beta * tanhf(g / beta) * sigmoidf_(g);
        float b = lin_beta * tanhf(u / lin_beta);
        return a * b;
    }
    if (kind == 1) return g * sigmoidf_(g) * u;
    if (kind == 2) return g;
    return u;
}
