"""Builds libmoe_xla.so with Bazel as part of `pip install .` / `pip install -e .`."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithBazel(build_py):
    def run(self):
        env = dict(os.environ, PYTHON_BIN_PATH=sys.executable)
        subprocess.check_call(["bash", str(ROOT / "scripts" / "build.sh")], cwd=ROOT, env=env)
        super().run()


setup(cmdclass={"build_py": BuildWithBazel})
