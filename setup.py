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

  BAGUALU2_SAVES=auto|1|0  build bagualu2._saves: auto (default) where torch imports, 1 always
                    (an error where torch does not import), 0 never

bagualu2._saves, the save path's C++ part (csrc/saves), links against torch's C++ API, whose ABI
holds within a release: it is built against the torch the build sees, and loads only under that
release. `pip install --no-build-isolation` builds against the torch already installed (the way
README "Install" gives). An isolated build (plain `pip install .`) cannot import torch, since
pyproject.toml does not list it among the build requirements, so that no build ever brings a torch
of its own: it builds the package without _saves, and the save path runs in its Python form
(bagualu2.runtime.saves_python, one warning at import saying how to rebuild). The package asks for
a torch range (pyproject.toml), never the build's release: installing it never replaces torch.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

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
            # Built against one torch release: a build left by another torch (the same checkout,
            # torch upgraded since) is rebuilt, never reused because its sources are older.
            import torch

            built = Path(self.get_ext_fullpath(ext.name))
            stamp = Path(self.build_temp) / "_saves.torch"
            against = f"{torch.__version__} {Path(torch.__file__).parent}"
            if built.exists() and (not stamp.exists() or stamp.read_text() != against):
                built.unlink()
            super().build_extension(ext)
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.write_text(against)
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


def torch_extension() -> Optional[Extension]:
    """bagualu2._saves, built against the torch this build imports; None where it imports none
    (BAGUALU2_SAVES=auto) or where it is not wanted (BAGUALU2_SAVES=0)."""
    wanted = os.environ.get("BAGUALU2_SAVES", "auto")
    if wanted not in ("auto", "1", "0"):
        raise SystemExit(f"BAGUALU2_SAVES={wanted!r}: expected auto, 1 or 0")
    if wanted == "0":
        return None
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        if wanted == "1":
            raise SystemExit(f"BAGUALU2_SAVES=1 and torch does not import in this build ({e}): install torch, then "
                             "build with pip install --no-build-isolation") from e
        print(f"bagualu2: torch does not import in this build environment ({e}): bagualu2._saves is not built, and "
              "the save path will run in Python. To build it against your torch: pip install --no-build-isolation .",
              file=sys.stderr)
        return None
    print(f"bagualu2: building bagualu2._saves against torch {torch.__version__}", file=sys.stderr)

    isystem = [arg for path in cpp_extension.include_paths() for arg in ("-isystem", path)]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    extension = Extension(
        "bagualu2._saves",
        sources=["csrc/saves/ledger.cpp", "csrc/saves/hooks.cpp", "csrc/meter/cpu_meter.cpp", "csrc/saves/module.cpp"],
        depends=["csrc/saves/ledger.h", "csrc/saves/hooks.h", "csrc/meter/cpu_meter.h", "csrc/common/check.h"],  # a change rebuilds it
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
    return extension


SAVES = torch_extension()
setup(
    ext_modules=[CMakeExtension("bagualu2._C")] + ([SAVES] if SAVES is not None else []),
    cmdclass={"build_ext": CMakeBuild},
)
