//! With the `cuda` feature: compile src/kernels/cuda/kernels.cu to PTX with nvcc (the pinned CUDA 13.0 one that
//! scripts/build-cuda-wheel.sh installs: $NVCC, else $CUDA_HOME/bin/nvcc, else nvcc on PATH) for compute
//! capability $CUDA_COMPUTE_CAP (default 90: H100/H200); src/kernels/cuda.rs embeds it. Without the feature: nothing.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/kernels/cuda/kernels.cu");
    for var in ["NVCC", "CUDA_HOME", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var_os("NVCC").map(PathBuf::from).unwrap_or_else(|| match std::env::var_os("CUDA_HOME") {
        Some(home) => PathBuf::from(home).join("bin").join("nvcc"),
        None => PathBuf::from("nvcc"),
    });
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("mbd_kernels.ptx");
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17", &format!("-arch=sm_{cap}"), "-o"])
        .arg(&out)
        .arg("src/kernels/cuda/kernels.cu")
        .status()
        .unwrap_or_else(|e| panic!("running {}: {e} (set NVCC or CUDA_HOME)", nvcc.display()));
    assert!(status.success(), "nvcc failed on src/kernels/cuda/kernels.cu");
}
