"""cuda_library: compiles .cu files with nvcc for Hopper and wraps the objects in a cc_library.

Each .cu file is one genrule (one nvcc process), so CUTLASS instantiations kept one per
file compile in parallel and are cached separately (disk cache in .bazelrc).
"""

load("@toolchains//:defs.bzl", "CUTLASS_INCLUDES", "HAS_CUDA", "NVCC")

# Targets that need CUDA are left out of `//...` on machines without nvcc.
CUDA_ONLY_TAGS = [] if HAS_CUDA else ["manual"]

_NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "--expt-relaxed-constexpr",
    "-Xcompiler=-fPIC",
    "-DNDEBUG",
    # wgmma/setmaxnreg need sm_90a; PTX of compute_90a rides along for the JIT.
    "-gencode=arch=compute_90a,code=[sm_90a,compute_90a]",
]

def cuda_library(name, srcs, hdrs = [], deps = [], cutlass = False, **kwargs):
    """Compiles `srcs` (.cu) with nvcc; `hdrs` are the project headers they include."""
    objs = []
    includes = ["-I."]
    extra_srcs = []
    if cutlass:
        includes += ["-Iexternal/toolchains/%s" % d for d in CUTLASS_INCLUDES]
        extra_srcs.append("@toolchains//:cutlass")
    for src in srcs:
        obj = "_objs/%s/%s.o" % (name, src.replace("/", "_")[:-3])
        native.genrule(
            name = "%s_%s_nvcc" % (name, src.replace("/", "_")[:-3]),
            srcs = [src] + hdrs + extra_srcs,
            outs = [obj],
            cmd = " ".join([NVCC] + _NVCC_FLAGS + includes + ["-c", "$(location %s)" % src, "-o", "$@"]),
            message = "nvcc %s" % src,
            tags = CUDA_ONLY_TAGS,
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@toolchains//:cudart_static", "@toolchains//:cuda_headers"],
        alwayslink = True,
        tags = CUDA_ONLY_TAGS + kwargs.pop("tags", []),
        **kwargs
    )
