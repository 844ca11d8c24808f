//! What this CPU can run: the one feature probe. Every kernel asks it and picks its own tiles from the answer
//! (`skinny`: AVX-512 / AVX2 / portable tiles; `panels`: `Zmm` / `Ymm`; [`qdot::Isa`](crate::kernels::qdot::Isa);
//! `vmath` and the blocked attention: AVX2 + FMA). `per_isa!` makes a loop's copies per instruction set and owns the
//! pick among them (the Gated DeltaNet's recurrence and convolution).

use std::sync::OnceLock;

/// The instruction-set features the kernels use, probed once per process (all false off x86-64).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cpu {
    /// AVX2 and FMA.
    pub avx2_fma: bool,
    /// F16C (the f16 scales of the block formats).
    pub f16c: bool,
    /// AVX-512 F.
    pub avx512f: bool,
    /// AVX-512 BW and VNNI (`vpdpbusd`).
    pub avx512_bw_vnni: bool,
}

impl Cpu {
    /// This CPU's features.
    pub fn get() -> Cpu {
        static CPU: OnceLock<Cpu> = OnceLock::new();
        *CPU.get_or_init(Cpu::probe)
    }

    fn probe() -> Cpu {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            Cpu {
                avx2_fma: has!("avx2") && has!("fma"),
                f16c: has!("f16c"),
                avx512f: has!("avx512f"),
                avx512_bw_vnni: has!("avx512bw") && has!("avx512vnni"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Cpu { avx2_fma: false, f16c: false, avx512f: false, avx512_bw_vnni: false }
    }

    /// AVX2, FMA and F16C: the floor of the x86 kernels (every CPU with AVX2 has FMA and F16C; checked all the
    /// same, since the block formats' f16 scales are converted with F16C).
    pub fn avx2(&self) -> bool {
        self.avx2_fma && self.f16c
    }

    /// `avx2` plus AVX-512 F: the 16-lane tiles.
    pub fn avx512(&self) -> bool {
        self.avx2() && self.avx512f
    }

    /// AVX-512 F, BW and VNNI with F16C: the integer dot products' `vpdpbusd` kernels.
    pub fn vnni(&self) -> bool {
        self.avx512f && self.avx512_bw_vnni && self.f16c
    }
}

/// Copies of one function compiled for each x86 instruction-set level, and the one run-time pick among them:
/// `per_isa! { mod m = f<'a>(arg: Type, ...) -> Ret; }` defines module `m` with
/// - `m::avx512` and `m::avx2`: `f` compiled with AVX-512 F, resp. AVX2, enabled (x86-64 only; unsafe: the caller
///   has checked the feature);
/// - `m::best`: the widest copy this CPU runs ([`Cpu::avx512`], else [`Cpu::avx2`]), else `f` as the baseline build
///   compiles it.
///
/// For loops whose arithmetic is the same at every level (no fused multiply-adds: Rust does not contract
/// a * b + c), so that only the vector width changes, never the bits.
macro_rules! per_isa {
    ($(#[$meta:meta])* mod $m:ident = $f:ident $(<$($lt:lifetime),*>)? ($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?;) => {
        $(#[$meta])*
        mod $m {
            #[allow(unused_imports)]
            use super::*;

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            pub(super) unsafe fn avx512 $(<$($lt),*>)? ($($arg: $ty),*) $(-> $ret)? {
                $f($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            pub(super) unsafe fn avx2 $(<$($lt),*>)? ($($arg: $ty),*) $(-> $ret)? {
                $f($($arg),*)
            }

            #[inline(always)]
            pub(super) fn best $(<$($lt),*>)? ($($arg: $ty),*) $(-> $ret)? {
                #[cfg(target_arch = "x86_64")]
                {
                    let cpu = $crate::kernels::cpu::Cpu::get();
                    if cpu.avx512() {
                        // SAFETY: AVX-512 F was detected
                        return unsafe { avx512($($arg),*) };
                    }
                    if cpu.avx2() {
                        // SAFETY: AVX2 was detected
                        return unsafe { avx2($($arg),*) };
                    }
                }
                $f($($arg),*)
            }
        }
    };
}
pub(crate) use per_isa;
