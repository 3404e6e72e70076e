//! Per-architecture SIMD paths behind safe dispatch functions, chosen at run time.
//!
//! Every kernel here follows its contract ([`crate::dot`], [`crate::bf16_contract`], [`crate::mxfp4_contract`],
//! [`crate::mxfp4_bf16_contract`], [`crate::mxfp4_i16_contract`], [`crate::int8_contract`]) and is tested bit for bit
//! against its scalar twin. On aarch64 the NEON kernels (`neon`) run every contract but the bf16-input MXFP4 one
//! (see there why); CI tests them under `qemu-aarch64`. [`kernel_set`] names the kernels each contract runs on.

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx2_bf16_lanes;
#[cfg(target_arch = "x86_64")]
pub mod avx2_tokens;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
#[cfg(target_arch = "x86_64")]
pub mod avx512_bf16_lanes;
#[cfg(target_arch = "x86_64")]
pub mod avx512_bf16_wide;
#[cfg(target_arch = "x86_64")]
pub mod avx512_f32_lanes;
#[cfg(target_arch = "x86_64")]
pub mod avx512_tokens;
#[cfg(target_arch = "aarch64")]
pub mod neon;

/// Whether AVX2 and FMA (x86-64-v3) are available; detected once. `DELTAFIN_NO_SIMD=1` forces the scalar
/// paths (for comparisons and debugging).
#[cfg(target_arch = "x86_64")]
pub fn has_avx2_fma() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        std::env::var_os("DELTAFIN_NO_SIMD").is_none()
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
    })
}

/// Whether AVX-512F and AVX-512BW (with AVX2 and FMA) are available and allowed; detected once.
/// `DELTAFIN_NO_AVX512=1` keeps the AVX2 paths (for comparisons); `DELTAFIN_NO_SIMD=1` turns both off.
#[cfg(target_arch = "x86_64")]
pub fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        has_avx2_fma()
            && std::env::var_os("DELTAFIN_NO_AVX512").is_none()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
    })
}

/// Whether AVX-512 BF16 is available on top of [`has_avx512`]; detected once. It runs the bf16-input MXFP4
/// contract ([`crate::mxfp4_bf16_contract`]); without it that contract runs its scalar reference.
#[cfg(target_arch = "x86_64")]
pub fn has_avx512_bf16() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| has_avx512() && std::arch::is_x86_feature_detected!("avx512bf16"))
}

/// Whether AVX-512 VNNI is available on top of [`has_avx512`]; detected once. It runs the int8 kernels
/// ([`crate::int8_contract`]) and the int16-input MXFP4 kernels ([`crate::mxfp4_i16_contract`]); without it both run
/// on AVX2 ([`avx2`]), and on their scalar references where AVX2 is missing too.
#[cfg(target_arch = "x86_64")]
pub fn has_avx512_vnni() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| has_avx512() && std::arch::is_x86_feature_detected!("avx512vnni"))
}

/// Whether the CPU is Intel's (`GenuineIntel` in CPUID leaf 0); read once. Where the best memory access pattern
/// differs between vendors ([`crate::bf16_contract::prefetch`]), the kernels ask.
pub fn is_intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static IS: OnceLock<bool> = OnceLock::new();
        *IS.get_or_init(|| {
            // CPUID leaf 0 exists on every x86-64 CPU.
            let id = std::arch::x86_64::__cpuid(0);
            let vendor = [id.ebx, id.edx, id.ecx].map(u32::to_le_bytes).concat();
            vendor == b"GenuineIntel"
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The CPU's family as CPUID leaf 1 reports it (the base family, plus the extended family where the base is 15);
/// read once; 0 off x86-64. AMD's Zen 3 and 4 are family 25 (0x19), Zen 5 26 (0x1A).
pub fn cpu_family() -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static FAMILY: OnceLock<u32> = OnceLock::new();
        *FAMILY.get_or_init(|| {
            // CPUID leaf 1 exists on every x86-64 CPU.
            let eax = std::arch::x86_64::__cpuid(1).eax;
            let base = (eax >> 8) & 0xf;
            if base == 0xf {
                base + ((eax >> 20) & 0xff)
            } else {
                base
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// Whether the NEON kernels are allowed; NEON is part of the aarch64 baseline, so only `DELTAFIN_NO_SIMD=1`
/// (for comparisons and debugging) turns them off. Read once.
#[cfg(target_arch = "aarch64")]
pub fn has_neon() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| std::env::var_os("DELTAFIN_NO_SIMD").is_none())
}

/// The lane kernels' tiles over rows `$r` = `$first .. $end` against groups `g .. g + $v` (`$v` at most 4): rows in
/// tiles of six while six remain, then four, two and one, each call `$tile::<ROWS, V>($args)` (the arguments may
/// name `$r`). Shared by the bf16 lane kernels, which walk the same tiles over different blocks. The caller states
/// the safety of the `$tile` calls, which the expansion makes inside `unsafe` blocks.
#[cfg(target_arch = "x86_64")]
macro_rules! lane_tiles {
    ($tile:ident; $r:ident in $first:expr, $end:expr; $v:expr; ($($arg:expr),*)) => {{
        let end = $end;
        let mut $r = $first;
        while $r < end {
            let left = end - $r;
            $crate::simd::lane_tiles!(@rows $tile; $r; left; $v; ($($arg),*); 6 4 2 1);
        }
    }};
    (@rows $tile:ident; $r:ident; $left:ident; $v:expr; $args:tt; $($rows:literal)+) => {
        $(
            if $left >= $rows {
                $crate::simd::lane_tiles!(@groups $tile; $rows; $v; $args);
                $r += $rows;
                continue;
            }
        )+
    };
    (@groups $tile:ident; $rows:literal; $v:expr; ($($arg:expr),*)) => {
        // SAFETY: as the invoking kernel states for its `$tile` calls.
        match $v {
            4 => unsafe { $tile::<$rows, 4>($($arg),*) },
            3 => unsafe { $tile::<$rows, 3>($($arg),*) },
            2 => unsafe { $tile::<$rows, 2>($($arg),*) },
            _ => unsafe { $tile::<$rows, 1>($($arg),*) },
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use lane_tiles;

/// A kernel choice forced by the environment variable `var`: `on` (true) or `off` (false); `None` (any other value,
/// or unset) leaves the choice to the caller's probe.
#[cfg(target_arch = "x86_64")]
pub(crate) fn forced_choice(var: &str) -> Option<bool> {
    match std::env::var(var).as_deref() {
        Ok("on") => Some(true),
        Ok("off") => Some(false),
        _ => None,
    }
}

/// Whether `b` runs faster than `a`: each timed [`PROBE_ROUNDS`] times, alternated, and the best times compared.
/// For a choice between two kernels that give the same bits, made once per process: the two times can lie close
/// together, so each gets several samples (one cut by an interrupt or by another thread's work must not decide).
#[cfg(target_arch = "x86_64")]
pub(crate) fn second_is_faster(mut a: impl FnMut(), mut b: impl FnMut()) -> bool {
    use std::time::Instant;
    let (mut best_a, mut best_b) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..PROBE_ROUNDS {
        let t = Instant::now();
        a();
        best_a = best_a.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        b();
        best_b = best_b.min(t.elapsed().as_secs_f64());
    }
    best_b < best_a
}

/// Samples of each kernel [`second_is_faster`] takes.
#[cfg(target_arch = "x86_64")]
const PROBE_ROUNDS: usize = 7;

/// Asks the CPU to start loading the cache lines of `v` (a hint; nothing on other architectures). For small data the
/// kernels read apart from their weights, such as a task's row scales: read on demand, each line would stall the
/// core for a memory round trip in the middle of its arithmetic.
pub fn prefetch_slice<T>(v: &[T]) {
    #[cfg(target_arch = "x86_64")]
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T0 }, T>(v);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

/// Asks the CPU to fetch the cache lines of `v` for writing (`prefetchw`: the lines arrive owned, so stores into them
/// do not wait for a read-for-ownership; a hint; nothing on other architectures). For a buffer about to be
/// overwritten whose lines are not in cache.
pub fn prefetch_slice_for_write<T>(v: &[T]) {
    #[cfg(target_arch = "x86_64")]
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_ET0 }, T>(v);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

/// `_mm_prefetch` with hint `HINT` of every 64-byte line of `v`.
#[cfg(target_arch = "x86_64")]
fn prefetch_lines<const HINT: i32, T>(v: &[T]) {
    prefetch_ahead::<HINT, T>(v.as_ptr(), std::mem::size_of_val(v), 0);
}

/// `_mm_prefetch` with hint `HINT` of the 64-byte lines covering `len` bytes from `dist` bytes past `p`: the
/// streaming kernels' prefetch ahead of their reads (the addresses may lie past any allocation: a prefetch is only
/// a hint).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_ahead<const HINT: i32, T>(p: *const T, len: usize, dist: usize) {
    let ahead = (p as *const i8).wrapping_add(dist);
    for off in (0..len).step_by(64) {
        // SAFETY: SSE is part of every x86-64 CPU, and a prefetch is a hint that never faults, wherever it points
        // (a CPU without `prefetchw` runs that hint as a no-op).
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(ahead.wrapping_add(off)) };
    }
}

/// Copies the reduced sums of every (row, group of 16 inputs) pair of a product with the inputs across the lanes into
/// `out` (`[rows][t_rows]`, row-major by weight row): `sums(r, g)` gives inputs `16g ..`, the last group cut at
/// `t_rows`. Shared by the MXFP4 and bf16 lane kernels of every width.
#[cfg(target_arch = "x86_64")]
pub(crate) fn copy_group_sums(
    out: &mut [f32],
    t_rows: usize,
    sums: impl Fn(usize, usize) -> [f32; crate::mxfp4_lanes::GROUP],
) {
    use crate::mxfp4_lanes::GROUP;
    const _: () = assert!(GROUP == crate::bf16_lanes::GROUP);
    for (r, row) in out.chunks_exact_mut(t_rows.max(1)).enumerate() {
        for (g, dst) in row.chunks_mut(GROUP).enumerate() {
            dst.copy_from_slice(&sums(r, g)[..dst.len()]);
        }
    }
}

/// Whether the bf16-input MXFP4 products run a SIMD kernel on this machine (AVX-512 BF16, or AVX2); without one they
/// run their scalar reference, far slower than the f32 path.
pub fn mxfp4_bf16_is_fast() -> bool {
    #[cfg(target_arch = "x86_64")]
    return has_avx512_bf16() || has_avx2_fma();
    #[allow(unreachable_code)]
    false
}

/// Whether the int16-input MXFP4 products run a SIMD kernel on this machine (AVX-512 VNNI, or AVX2); without one
/// they run their scalar reference, far slower than the f32 path.
pub fn mxfp4_i16_is_fast() -> bool {
    #[cfg(target_arch = "x86_64")]
    return has_avx512_vnni() || has_avx2_fma();
    #[cfg(target_arch = "aarch64")]
    return has_neon();
    #[allow(unreachable_code)]
    false
}

/// The name of the kernel path in use (for logs and benchmarks).
pub fn path_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        return "avx512";
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        return "avx2+fma";
    }
    #[cfg(target_arch = "aarch64")]
    if has_neon() {
        return "neon";
    }
    #[allow(unreachable_code)]
    "scalar"
}

/// A kernel contract of this crate, for [`kernel_set`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Contract {
    /// f32 and bf16 dense rows ([`crate::dot`], [`crate::bf16_contract`]).
    Dense,
    /// Row-wise int8 ([`crate::int8_contract`]).
    Int8,
    /// MXFP4 with f32 inputs ([`crate::mxfp4_contract`]).
    Mxfp4F32,
    /// MXFP4 with bf16 inputs ([`crate::mxfp4_bf16_contract`]).
    Mxfp4Bf16,
    /// MXFP4 with int16 inputs ([`crate::mxfp4_i16_contract`]).
    Mxfp4I16,
    /// The int16 quantisation of inputs ([`crate::quantise`]).
    Quantise,
}

impl Contract {
    /// Every contract.
    pub const ALL: [Contract; 6] = [
        Self::Dense,
        Self::Int8,
        Self::Mxfp4F32,
        Self::Mxfp4Bf16,
        Self::Mxfp4I16,
        Self::Quantise,
    ];
}

/// The kernels `contract` runs on this machine, as its dispatch function chooses them: `avx512`, `avx2`, `neon` or
/// `scalar` (for logs and tests).
pub fn kernel_set(contract: Contract) -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = match contract {
            Contract::Int8 | Contract::Mxfp4I16 => has_avx512_vnni(),
            Contract::Mxfp4Bf16 => has_avx512_bf16(),
            Contract::Dense | Contract::Mxfp4F32 | Contract::Quantise => has_avx512(),
        };
        if avx512 {
            return "avx512";
        }
        if has_avx2_fma() {
            return "avx2";
        }
    }
    #[cfg(target_arch = "aarch64")]
    if contract != Contract::Mxfp4Bf16 && has_neon() {
        return "neon";
    }
    let _ = contract;
    "scalar"
}
