"""Builds the Python package `rewind` (rewind._rewind and python/rewind/*.py) with CMake.

setuptools is the backend because Debian 12 packages it (python3-setuptools, python3-wheel) and no CMake-aware
backend, so `pip install --no-build-isolation .` works offline. Metadata is in pyproject.toml; this file only
adds the CMake build of the extension: the C++ library, the reference runtime and the pybind11 module for the
interpreter running the build, nothing else (no tests, benchmarks, fuzzers, Redis). The module reaches torch
through DLPack and links no torch, so one build serves any torch version.

Environment: CMAKE_ARGS (extra arguments to the CMake configure step, split like a shell would),
CMAKE_BUILD_PARALLEL_LEVEL (build jobs; default: the CPU count).
"""

import glob
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def project_version():
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        match = re.search(r"project\(\s*rewind\s+VERSION\s+([0-9][0-9.]*)", f.read())
    if not match:
        sys.exit("setup.py: no `project(rewind VERSION x.y.z ...)` in CMakeLists.txt to take the version from")
    return match.group(1)


def pybind11_cmake_args():
    # The interpreter's own pybind11 first (a pip-installed one may support a newer Python than the system's);
    # without one, CMake's search finds Debian's pybind11-dev.
    try:
        import pybind11
    except ImportError:
        return []
    return ["-Dpybind11_DIR=" + pybind11.get_cmake_dir()]


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        if shutil.which("cmake") is None:
            raise RuntimeError("building rewind._rewind needs CMake 3.25+ on PATH (Debian: apt-get install cmake)")
        # One CMake tree per interpreter: its cache records the Python it was configured for.
        interpreter = hashlib.sha1(os.path.realpath(sys.executable).encode()).hexdigest()[:10]
        tree = os.path.abspath(os.path.join(self.build_temp, "cmake-" + interpreter))
        configure = [
            "cmake", "-S", ROOT, "-B", tree,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DREWIND_BUILD_PYTHON=ON", "-DREWIND_BUILD_RUNTIME=ON",
            "-DREWIND_BUILD_TESTS=OFF", "-DREWIND_BUILD_BENCH=OFF", "-DREWIND_BUILD_REDIS=OFF", "-DREWIND_BUILD_SERVER=OFF",
            "-DREWIND_SANITIZE=OFF", "-DREWIND_TSAN=OFF", "-DREWIND_FUZZ=OFF", "-DREWIND_WERROR=OFF",
            "-DPYTHON_EXECUTABLE=" + sys.executable,
        ] + pybind11_cmake_args() + shlex.split(os.environ.get("CMAKE_ARGS", ""))
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", tree, "--target", "rewind_python", "-j", jobs], check=True)
        built = glob.glob(os.path.join(tree, "python", "rewind", "_rewind*.so"))
        if len(built) != 1:
            raise RuntimeError(
                f"the CMake build left {len(built)} rewind._rewind modules in {tree}/python/rewind (expected one; "
                "is pybind11 found? Debian: apt-get install pybind11-dev python3-dev)")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built[0], target)
        shutil.copymode(built[0], target)


setup(
    version=project_version(),
    packages=["rewind"],
    package_dir={"rewind": "python/rewind"},
    ext_modules=[Extension("rewind._rewind", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    # Not build/: that is the CMake build directory of the Makefile.
    options={"build": {"build_base": "build-pip"}},
    zip_safe=False,
)
