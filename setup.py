"""Builds libmoe_xla.so with Bazel as part of `pip install .` / `pip wheel .` and tags the
wheel for the platform of that binary.

The library is C ABI only (ctypes loads it; no Python in it), so one wheel serves every
CPython 3: the tag is py3-none-<platform>. On Linux the platform is manylinux_2_<N>_<arch>
with N the newest glibc symbol version the library references (libstdc++ and libgcc are
linked in, moe_xla/BUILD.bazel), or plain linux_<arch> if it still needs libstdc++.
"""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent
LIBRARY = ROOT / "moe_xla" / "_native" / "libmoe_xla.so"


def platform_tag(library: Path) -> str:
    """The wheel platform tag of a Linux shared library (see the module docstring)."""
    arch = platform.machine()
    data = library.read_bytes()
    if b"libstdc++.so" in data:
        return f"linux_{arch}"
    minors = [int(m) for m in re.findall(rb"GLIBC_2\.(\d+)", data)]
    return f"manylinux_2_{max(minors, default=17)}_{arch}"


class BuildWithBazel(build_py):
    def run(self):
        env = dict(os.environ, PYTHON_BIN_PATH=sys.executable)
        subprocess.check_call(["bash", str(ROOT / "scripts" / "build.sh")], cwd=ROOT, env=env)
        super().run()


class PlatformWheel(bdist_wheel):
    """A wheel with a binary in it: not pure, tagged py3-none-<platform of the binary>."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        return "py3", "none", platform_tag(LIBRARY)


setup(cmdclass={"build_py": BuildWithBazel, "bdist_wheel": PlatformWheel})
