#!/usr/bin/env python3
"""Compiles kernels/*.cu as the engine does (one concatenated source, NVRTC, C++17) for sm_90a (or $ARCH) without a GPU, and
prints each entry point's registers, spills and stack from ptxas, and any "Performance Loss" it reports (warpgroup mmas
serialised): a quick check of a kernel edit before a device call (the engine itself compiles with the device's NVRTC
at first use, kernel_cache.rs). With $SASS_DIR set, the cubin and the disassembly of each matching entry point
(`NAME.sass`, by cuobjdump, which needs nvdisasm beside it) are written there.

Needs NVRTC and ptxas, for example from the NVIDIA wheels (no GPU or driver needed):
    pip download --no-deps nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12 -d /tmp/nvpkgs
    for w in /tmp/nvpkgs/*.whl; do python3 -m zipfile -e "$w" /tmp/nv; done; chmod +x /tmp/nv/nvidia/cuda_nvcc/bin/*
and for the disassembly `pip download --no-deps nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` the same way
(chmod +x /tmp/nv/nvidia/cu13/bin/*).
Usage: scripts/cuda-compile-check.py [NAME_FILTER]   (NVRTC_LIB, PTXAS and CUOBJDUMP override the /tmp/nv paths)
"""
import ctypes
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels")
# The order of SOURCES in crates/quant/src/cuda/mod.rs.
SOURCES = ["common.cuh", "moe_mxfp4.cu", "dense.cu", "attention.cu"]
NVRTC = os.environ.get("NVRTC_LIB", "/tmp/nv/nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
PTXAS = os.environ.get("PTXAS", "/tmp/nv/nvidia/cuda_nvcc/bin/ptxas")
CUOBJDUMP = os.environ.get("CUOBJDUMP", "/tmp/nv/nvidia/cu13/bin/cuobjdump")
# sm_90a: the architecture the engine compiles for on Hopper (kernel_cache.rs); ARCH=80 checks the generic path.
ARCH = os.environ.get("ARCH", "90a")


def nvrtc_ptx(src):
    lib = ctypes.CDLL(NVRTC)
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kernels.cu", 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture=compute_{ARCH}".encode(), b"--std=c++17"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if log.value.strip():
        print(log.value.decode(errors="replace"))
    if rc != 0:
        sys.exit("NVRTC compile failed")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value


def main():
    pattern = sys.argv[1] if len(sys.argv) > 1 else ""
    src = "".join(open(os.path.join(ROOT, f)).read() + "\n" for f in SOURCES)
    sass_dir = os.environ.get("SASS_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernels.ptx")
        cubin = os.path.join(sass_dir or tmp, "kernels.cubin")
        if sass_dir:
            os.makedirs(sass_dir, exist_ok=True)
        with open(ptx, "wb") as f:
            f.write(nvrtc_ptx(src))
        out = subprocess.run([PTXAS, f"-arch=sm_{ARCH}", "-v", ptx, "-o", cubin], capture_output=True, text=True)
    name, names = None, []
    for line in out.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
            if pattern in name:
                names.append(name)
        elif "Performance Loss" in line:
            print(line)
        elif name and pattern in name and ("registers" in line or "spill" in line):
            print(f"{name}: {line.split(':', 1)[-1].strip()}")
    if out.returncode != 0:
        print(out.stderr[-4000:])
        sys.exit("ptxas failed")
    for name in names if sass_dir else []:
        with open(os.path.join(sass_dir, f"{name}.sass"), "w") as f:
            subprocess.run([CUOBJDUMP, "-sass", "-fun", name, cubin], stdout=f, check=True)


if __name__ == "__main__":
    main()
