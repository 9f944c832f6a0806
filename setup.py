"""Build bagualu2._C with CMake + Ninja (in the style of pybind/cmake_example).

Environment:
  BAGUALU2_BACKEND  auto|cpu|cuda|hip  (forwarded to the CMake cache variable of that name;
                    auto builds cpu+cuda+hip: GPU runtimes are loaded at first use, no toolkit
                    is needed, see docs/backends.md)
  BAGUALU2_TEST_HOOKS=1|0  build the test-only module tests/bagualu2_test_hooks*.so (default:
                    on for editable/in-place builds, off for wheels, which never ship it)
  CMAKE_ARGS        extra CMake arguments, space separated
  DEBUG=1           Debug build
  MAX_JOBS          parallel build jobs
  BAGUALU2_SANITIZE=1  ASan + UBSan build

bagualu2._saves, the save path's C++ part (csrc/saves), links against torch: it is built against
the torch of the build environment (pyproject.toml pins it; `pip install --no-build-isolation`
builds against the torch already installed), and the package then asks for that torch release.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Tuple

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class CMakeExtension(Extension):
    def __init__(self, name: str, sourcedir: str = "") -> None:
        super().__init__(name, sources=[])
        self.sourcedir = os.fspath(Path(sourcedir).resolve())


def _stale_cache(build_temp: Path) -> bool:
    """A CMake cache written by another (isolated, since deleted) build environment points at a
    cmake/ninja that no longer exists; reusing it fails. Such a cache is thrown away."""
    cache = build_temp / "CMakeCache.txt"
    if not cache.exists():
        return False
    for line in cache.read_text(errors="replace").splitlines():
        for key in ("CMAKE_COMMAND:INTERNAL=", "CMAKE_MAKE_PROGRAM:FILEPATH="):
            if line.startswith(key) and not Path(line[len(key):]).exists():
                return True
    return False


class CMakeBuild(build_ext):
    def run(self) -> None:
        # setuptools clears `inplace` while building (it copies into the tree afterwards), so the
        # kind of build is read here: in-place and editable builds are the ones tests run on.
        self._in_tree = bool(self.inplace or getattr(self, "editable_mode", False))
        super().run()

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):  # bagualu2._saves: setuptools builds it
            super().build_extension(ext)
            return
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
        try:  # the ninja of this build environment, not whatever a cache remembers
            import ninja

            cmake_args.append(f"-DCMAKE_MAKE_PROGRAM:FILEPATH={Path(ninja.BIN_DIR) / 'ninja'}")
        except ImportError:
            pass
        # Test hooks go beside the tests (tests/test_hooks.cpp), never into the package.
        hooks = os.environ.get("BAGUALU2_TEST_HOOKS", "1" if getattr(self, "_in_tree", False) else "0") == "1"
        cmake_args.append(f"-DBAGUALU2_TEST_HOOKS={'ON' if hooks else 'OFF'}")
        if hooks:
            cmake_args.append(f"-DBAGUALU2_TEST_HOOKS_DIR={Path(ext.sourcedir) / 'tests'}")
        if "CMAKE_ARGS" in os.environ:
            cmake_args += [item for item in os.environ["CMAKE_ARGS"].split(" ") if item]
        build_args = ["--config", cfg]
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        build_args += [f"-j{jobs}"]

        build_temp = Path(self.build_temp) / ext.name
        if _stale_cache(build_temp):
            shutil.rmtree(build_temp)
        build_temp.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cmake", ext.sourcedir, *cmake_args], cwd=build_temp, check=True)
        subprocess.run(["cmake", "--build", ".", *build_args], cwd=build_temp, check=True)


def torch_extension() -> Tuple[Extension, str]:
    """bagualu2._saves, and the torch requirement it brings (the build's torch release)."""
    import torch
    from torch.utils import cpp_extension

    isystem = [arg for path in cpp_extension.include_paths() for arg in ("-isystem", path)]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    extension = Extension(
        "bagualu2._saves",
        sources=["csrc/saves/ledger.cpp", "csrc/saves/hooks.cpp", "csrc/saves/module.cpp"],
        depends=["csrc/saves/ledger.h", "csrc/saves/hooks.h", "csrc/common/check.h"],  # a change rebuilds it
        include_dirs=["csrc"],
        library_dirs=cpp_extension.library_paths(),
        libraries=["c10", "torch", "torch_cpu", "torch_python"],
        extra_compile_args=[*isystem, "-std=c++20", "-O2", "-Wall", "-Wextra", "-Werror",
                            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                            "-fvisibility=hidden"],
        language="c++",
    )
    if os.environ.get("BAGUALU2_SANITIZE") == "1":  # as the CMake build's (CMakeLists.txt)
        sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
        extension.extra_compile_args += sanitize
        extension.extra_link_args = sanitize
    return extension, f"torch=={major}.{minor}.*"


SAVES, TORCH_REQUIREMENT = torch_extension()
setup(
    ext_modules=[CMakeExtension("bagualu2._C"), SAVES],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=[TORCH_REQUIREMENT, "numpy", "tqdm", "matplotlib"],
)
