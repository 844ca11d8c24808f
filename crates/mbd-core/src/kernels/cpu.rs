//! What this CPU can run: the one feature probe. Every kernel asks it and picks its own tiles from the answer
//! (`skinny`: AVX-512 / AVX2 / portable tiles; `panels`: `Zmm` / `Ymm`; `qdot::Isa`; `vmath` and the blocked
//! attention: AVX2 + FMA).

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
