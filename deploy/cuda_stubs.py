#!/usr/bin/env python3
"""Writes link stubs of the CUDA libraries relay's `cuda` build links.

candle turns on cudarc's `dynamic-linking`, so a `cuda` binary names
libcuda (the driver), cuBLAS, cuBLASLt, cuRAND and NVRTC as needed
libraries. A machine that builds relay has no driver, and PyPI's wheels ship
neither a libcuda stub nor the unversioned names the linker looks for. As
the CUDA toolkit's own `lib64/stubs` do, each stub here is a shared library
with the real one's soname that exports every function cudarc binds (read
from cudarc's generated bindings) and answers each with an error code. The
linker resolves against it; at run time the real library of the same soname
is found instead (the driver's libcuda.so.1, the toolkit's or PyTorch's
cuBLAS). Put on LD_LIBRARY_PATH of a machine without the driver, they let a
`cuda` binary start and run on the CPU: asking for a GPU then fails with
CUDA_ERROR_STUB_LIBRARY (34) rather than the binary not starting.

usage: cuda_stubs.py CUDARC_SRC_DIR CUDA_MAJOR OUT_DIR
"""

import os
import re
import subprocess
import sys
import tempfile

# cudarc module -> (library name, soname given the CUDA major version, the
# error code every stub returns: each API's "not initialized" or "stub").
LIBRARIES = {
    "driver": ("cuda", lambda major: "libcuda.so.1", 34),
    "cublas": ("cublas", lambda major: f"libcublas.so.{major}", 1),
    "cublaslt": ("cublasLt", lambda major: f"libcublasLt.so.{major}", 1),
    "curand": ("curand", lambda major: "libcurand.so.10", 101),
    "nvrtc": ("nvrtc", lambda major: f"libnvrtc.so.{major}", 11),
}

# bindgen writes each signature on one line; what follows `->` tells a
# status code (returned as the error) from a pointer (returned as null).
FUNCTION = re.compile(r"^pub unsafe fn ([A-Za-z_][A-Za-z0-9_]*)\(.*?\)(?: -> ([^{]+))? \{$", re.MULTILINE)


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    cudarc_src, major, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.makedirs(out_dir, exist_ok=True)
    for module, (name, soname_of, error) in LIBRARIES.items():
        bindings = os.path.join(cudarc_src, "src", module, "sys", "mod.rs")
        with open(bindings, encoding="utf-8") as f:
            functions = dict(FUNCTION.findall(f.read()))
        if not functions:
            print(f"cuda_stubs: no functions in {bindings}", file=sys.stderr)
            return 1
        soname = soname_of(major)
        # Every stub takes no parameters: under the x86-64 System V ABI a
        # caller passing arguments to it is harmless.
        source = "".join(
            f"void *{fn}(void) {{ return 0; }}\n"
            if returns.strip().startswith("*")
            else f"long {fn}(void) {{ return {error}; }}\n"
            for fn, returns in sorted(functions.items())
        )
        with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as c:
            c.write(source)
        unversioned = os.path.join(out_dir, f"lib{name}.so")
        try:
            subprocess.run(
                ["cc", "-shared", "-fPIC", "-O0", f"-Wl,-soname,{soname}", "-o", unversioned, c.name],
                check=True,
            )
        finally:
            os.unlink(c.name)
        versioned = os.path.join(out_dir, soname)
        if os.path.lexists(versioned):
            os.unlink(versioned)
        os.symlink(os.path.basename(unversioned), versioned)
        print(f"cuda_stubs: {soname}: {len(functions)} functions", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
