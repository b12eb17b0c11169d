"""CUDA rules: .cu files compiled by nvcc in genrules, the objects wrapped in a cc_library.

Each .cu compilation is one genrule (one nvcc process), so CUTLASS instantiations kept one
per compilation unit compile in parallel and are cached one by one (disk cache in
.bazelrc). Every file an nvcc command reads from the workspace or from @toolchains is a
declared input, so the genrules run sandboxed; nvcc and the CUDA toolkit's own headers are
read from their absolute path outside the sandbox.
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
]

# Code that uses Hopper-only instructions (wgmma, setmaxnreg, TMA multicast need sm_90a).
# The compute_90a PTX rides along but runs on compute capability 9.0 only: later GPUs
# cannot JIT-compile it.
HOPPER_ARCHS = ["-gencode=arch=compute_90a,code=[sm_90a,compute_90a]"]

# Code that needs no Hopper instruction: SASS for sm_80 (runs on every 8.x GPU), sm_90a
# (9.0) and sm_100 (10.0), and compute_100 PTX that the driver JIT-compiles on later GPUs.
# cuda/device_support.h states the same capability ranges; keep the two in step.
PORTABLE_ARCHS = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_100,code=[sm_100,compute_100]",
]

def _nvcc_object(library, stem, src, hdrs, archs, defines = [], cutlass = False):
    """One genrule, `library`_`stem`_nvcc, that compiles `src` into
    _objs/`library`/`stem`.o and returns that object's name.

    `hdrs` are the project headers (and generated files) that `src` includes; `archs` the
    -gencode flags; `defines` extra -D flags; `cutlass` adds the CUTLASS/CuTe headers.
    """
    out = "_objs/%s/%s.o" % (library, stem)
    includes = ["-I.", "-I$(GENDIR)"]
    extra_srcs = []
    if cutlass:
        includes += ["-Iexternal/toolchains/%s" % d for d in CUTLASS_INCLUDES]
        extra_srcs.append("@toolchains//:cutlass")
    native.genrule(
        name = "%s_%s_nvcc" % (library, stem),
        srcs = [src] + hdrs + extra_srcs,
        outs = [out],
        cmd = " ".join([NVCC] + _NVCC_FLAGS + archs + ["-D%s" % d for d in defines] + includes +
                       ["-c", "$(location %s)" % src, "-o", "$@"]),
        message = "nvcc %s %s" % (src, " ".join(defines)),
        tags = CUDA_ONLY_TAGS,
    )
    return out

def _objects_library(name, objs, hdrs, deps, kwargs):
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = [h for h in hdrs if h.endswith(".h")],
        deps = deps + ["@toolchains//:cudart_static", "@toolchains//:cuda_headers"],
        alwayslink = True,
        tags = CUDA_ONLY_TAGS + kwargs.pop("tags", []),
        **kwargs
    )

def cuda_library(name, srcs, hdrs = [], deps = [], archs = PORTABLE_ARCHS, **kwargs):
    """Compiles each of `srcs` (.cu) with nvcc; `hdrs` are the project headers they include.

    The library exports the .h headers among `hdrs` to its dependents.
    """
    objs = [_nvcc_object(name, src.replace("/", "_")[:-3], src, hdrs, archs) for src in srcs]
    _objects_library(name, objs, hdrs, deps, kwargs)

# Short names of the enumerators in a CUTLASS instance's object file name; others are
# written in snake case (kCoop128x256Cluster1x2 -> coop128x256cluster1x2).
_SHORT_NAMES = {
    "kBF16": "bf16",
    "kF16": "f16",
    "kF32": "f32",
    "kGmm": "gmm",
    "kGmmTransposed": "gmm_t",
    "kTgmm": "tgmm",
}

def _short(enumerator):
    return _SHORT_NAMES.get(enumerator, enumerator[1:].lower())

def cutlass_instances(name, src, instances, fields = ("DTYPE", "LAYOUT", "TILE"), hdrs = [], deps = [], **kwargs):
    """The CUTLASS instantiations of the table `instances`.

    Each entry of `instances` is a tuple of enumerator names, one per entry of `fields`
    (by default the DType, GroupedLayout and TileConfig of a bf16/f16 grouped GEMM). Each
    entry is one nvcc compilation of `src` with -DMOE_XLA_CUTLASS_<field>=<enumerator>. The
    genrule `name`_list writes `name`.inc, one MOE_XLA_CUTLASS_INSTANCE(<enumerators>) line
    per entry, from which the dispatcher builds its list of the compiled instantiations.
    """
    objs = []
    for entry in instances:
        if len(entry) != len(fields):
            fail("cutlass_instances %s: entry %s does not have one enumerator per field of %s" % (name, entry, fields))
        objs.append(_nvcc_object(
            name,
            "cutlass_" + "_".join([_short(e) for e in entry]),
            src,
            hdrs,
            HOPPER_ARCHS,
            defines = ["MOE_XLA_CUTLASS_%s=%s" % (f, e) for f, e in zip(fields, entry)],
            cutlass = True,
        ))
    native.genrule(
        name = name + "_list",
        outs = [name + ".inc"],
        cmd = "printf '%%s\\n' %s > $@" % " ".join([
            "'MOE_XLA_CUTLASS_INSTANCE(%s)'" % ", ".join(entry)
            for entry in instances
        ]),
    )
    _objects_library(name, objs, hdrs, deps, kwargs)
