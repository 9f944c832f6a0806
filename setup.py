"""Build bagualu2._C with CMake + Ninja (in the style of pybind/cmake_example).

Environment:
  BAGUALU2_BACKEND  auto|cpu|cuda|hip  (forwarded to the CMake cache variable of that name)
  CMAKE_ARGS        extra CMake arguments, space separated
  DEBUG=1           Debug build
  MAX_JOBS          parallel build jobs
  BAGUALU2_SANITIZE=1  ASan + UBSan build
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class CMakeExtension(Extension):
    def __init__(self, name: str, sourcedir: str = "") -> None:
        super().__init__(name, sources=[])
        self.sourcedir = os.fspath(Path(sourcedir).resolve())


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11

        ext_fullpath = Path.cwd() / self.get_ext_fullpath(ext.name)
        extdir = ext_fullpath.parent.resolve()
        debug = int(os.environ.get("DEBUG", 0)) if self.debug is None else self.debug
        cfg = "Debug" if debug else "Release"
        backend = os.environ.get("BAGUALU2_BACKEND", "auto")

        cmake_args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}{os.sep}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DBAGUALU2_BACKEND={backend}",
            f"-DBAGUALU2_SANITIZE={'ON' if os.environ.get('BAGUALU2_SANITIZE') == '1' else 'OFF'}",
            "-GNinja",
        ]
        if "CMAKE_ARGS" in os.environ:
            cmake_args += [item for item in os.environ["CMAKE_ARGS"].split(" ") if item]
        build_args = ["--config", cfg]
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        build_args += [f"-j{jobs}"]

        build_temp = Path(self.build_temp) / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cmake", ext.sourcedir, *cmake_args], cwd=build_temp, check=True)
        subprocess.run(["cmake", "--build", ".", *build_args], cwd=build_temp, check=True)


setup(ext_modules=[CMakeExtension("bagualu2._C")], cmdclass={"build_ext": CMakeBuild})
