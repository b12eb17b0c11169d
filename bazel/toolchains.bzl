"""Repository rule that finds the build's outside inputs on this machine.

It asks `python3` (or $PYTHON_BIN_PATH) where jaxlib keeps the XLA FFI headers and where
`nvidia-cutlass` keeps the CUTLASS/CuTe headers, and looks for the CUDA toolkit in
$CUDA_PATH or /usr/local/cuda. The generated repository holds:
  //:xla_ffi         cc_library with the XLA FFI C++ headers
  //:cutlass         filegroup of CUTLASS + CuTe headers (and their include dirs)
  //:cuda_headers    cc_library with the CUDA runtime headers (only if CUDA is found)
  //:cudart_static   cc_library linking the static CUDA runtime (only if CUDA is found)
  //:defs.bzl        HAS_CUDA, NVCC, CUTLASS_INCLUDES, PYTHON (absolute path, for genrules)
"""

_FIND_PY = """
import os, sys
import jax.ffi
print(sys.executable)
print(jax.ffi.include_dir())
try:
    import cutlass_library
    print(os.path.join(os.path.dirname(cutlass_library.__file__), "source"))
except ImportError:
    print("")
"""

def _impl(ctx):
    python = ctx.os.environ.get("PYTHON_BIN_PATH", "python3")
    res = ctx.execute([python, "-c", _FIND_PY])
    if res.return_code != 0:
        fail("moe_xla: `%s` could not import jax to find the XLA FFI headers " % python +
             "(pip install jax jaxlib):\n" + res.stderr)
    lines = res.stdout.strip().split("\n")
    python_path, ffi_include = lines[0], lines[1]
    cutlass_root = lines[2] if len(lines) > 2 else ""
    ctx.symlink(ffi_include, "xla_ffi/include")

    cuda_path = ctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    nvcc = ctx.path(cuda_path + "/bin/nvcc")
    want_cuda = ctx.os.environ.get("MOE_XLA_CUDA", "auto") != "0"
    has_cuda = want_cuda and nvcc.exists and cutlass_root != ""
    if want_cuda and nvcc.exists and cutlass_root == "":
        print("moe_xla: nvcc found but nvidia-cutlass is not installed; building the CPU part only")

    build = ["package(default_visibility = [\"//visibility:public\"])", """
cc_library(
    name = "xla_ffi",
    hdrs = glob(["xla_ffi/include/xla/ffi/api/*.h"]),
    includes = ["xla_ffi/include"],
)
"""]
    if has_cuda:
        ctx.symlink(cutlass_root + "/include", "cutlass/include")
        ctx.symlink(cutlass_root + "/tools/util/include", "cutlass/util_include")
        ctx.symlink(cuda_path + "/include", "cuda/include")
        ctx.symlink(cuda_path + "/lib64/libcudart_static.a", "cuda/lib/libcudart_static.a")
        build.append("""
filegroup(
    name = "cutlass",
    srcs = glob(["cutlass/include/**/*.h", "cutlass/include/**/*.hpp", "cutlass/include/**/*.inl",
                 "cutlass/util_include/**/*.h", "cutlass/util_include/**/*.hpp"]),
)

cc_library(
    name = "cuda_headers",
    hdrs = glob(["cuda/include/*.h", "cuda/include/*.hpp", "cuda/include/crt/*.h",
                 "cuda/include/crt/*.hpp"]),
    includes = ["cuda/include"],
)

cc_library(
    name = "cudart_static",
    srcs = ["cuda/lib/libcudart_static.a"],
    linkopts = ["-ldl", "-lrt", "-lpthread"],
)
""")
    ctx.file("BUILD.bazel", "\n".join(build))
    ctx.file("defs.bzl", "\n".join([
        "HAS_CUDA = %s" % has_cuda,
        "NVCC = %r" % (str(nvcc) if has_cuda else ""),
        "CUTLASS_INCLUDES = %r" % (["cutlass/include", "cutlass/util_include"] if has_cuda else []),
        "PYTHON = %r" % python_path,
        "",
    ]))

moe_xla_toolchains = repository_rule(
    implementation = _impl,
    environ = ["PYTHON_BIN_PATH", "CUDA_PATH", "MOE_XLA_CUDA", "PATH"],
    local = True,
)
