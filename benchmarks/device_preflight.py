"""The device check's preflight: what the build and the checks need, checked first, each missing
piece named with what to do about it. No network, no downloads, nothing installed.

    python3 benchmarks/device_preflight.py                  # before the build: torch, compiler, tools
    python3 benchmarks/device_preflight.py --after-build    # also: the in-place build loads, _saves included
    python3 benchmarks/device_preflight.py --dry-run        # the plan, and that every check runs here
    python3 benchmarks/device_preflight.py --json OUT.json  # every result in one JSON too

Checks (each ok, missing or warn, with the reason; exit 1 where one the build needs is missing):
  python      3.10 or newer; `python3` on the PATH (what the device machines' commands call)
  torch       imports; release within the supported range (2.11 to 2.15); its CUDA or HIP build,
              and whether it sees a device (a CPU-only torch: warn, the device rows will not run)
  headers     torch's C++ headers and libraries (torch.utils.cpp_extension), which _saves needs
  compiler    a C++ compiler that builds C++20 against torch's, pybind11's and Python's headers:
              a few lines compiled for syntax (seconds)
  build-tools setuptools, pybind11, cmake and ninja importable or on the PATH: with no network
              there is no build isolation, so they must be installed beside torch
  saves       where bagualu2 is built in place: _C loads, and _saves loads under this torch and was
              built against its release (else the save path would run in Python: say so); before
              the build, what is there (none, or built for another torch: the build replaces it)

Used as a module: ``run(after_build=False) -> dict`` (the same results) and ``ok(results)``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
TORCH_RANGE = ((2, 11), (2, 15))  # pyproject.toml asks for torch>=2.11; 2.15 the newest release tested against
PYTHON_FLOOR = (3, 10)
# A light translation unit (Python's, pybind11's and torch's headers, a C++20 operator): it
# finds a missing or unusable toolchain in seconds, before the build does.
PROBE_SOURCE = """#include <Python.h>
#include <pybind11/pybind11.h>
#include <torch/headeronly/version.h>
#include <c10/macros/Macros.h>
#include <compare>
static_assert(TORCH_VERSION_MAJOR >= 2, "torch 2");
int main() { return (1 <=> 2) < 0 ? 0 : 1; }
"""
# Run in a child interpreter: what this process imported must not decide what loads.
SAVES_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
out = {}
try:
    import torch
    out["torch"] = torch.__version__
    import importlib.util
    spec = importlib.util.find_spec("bagualu2._saves")
    out["saves_file"] = spec.origin if spec else None
    import bagualu2
    out["bagualu2"] = bagualu2.__file__
    from bagualu2.runtime import ledger
    out["save_path"] = ledger.SAVE_PATH
    out["reason"] = ledger.SAVE_PATH_REASON
    out["backends"] = {k: {"usable": v["usable"], "reason": v.get("reason", "")}
                       for k, v in bagualu2.backend_status().items()}
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def _result(status: str, detail: str, **extra: Any) -> Dict[str, Any]:
    return {"status": status, "detail": detail, **extra}


def check_python() -> Dict[str, Any]:
    version = sys.version_info[:2]
    python3 = shutil.which("python3")
    if version < PYTHON_FLOOR:
        return _result("missing", f"Python {sys.version.split()[0]}: bagualu2 needs {PYTHON_FLOOR[0]}.{PYTHON_FLOOR[1]} or newer")
    if python3 is None:
        return _result("missing", "no python3 on the PATH: the device check's commands call python3")
    return _result("ok", f"Python {sys.version.split()[0]} ({sys.executable}); python3 is {python3}")


def check_torch() -> Dict[str, Any]:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any failure to import is what is reported
        return _result("missing", f"torch does not import ({type(e).__name__}: {e}): install torch 2.11 or newer "
                       "(the device machines carry 2.11.0+cu130)")
    release = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}
    if release < TORCH_RANGE[0]:
        return _result("missing", f"torch {torch.__version__} is older than the supported range "
                       f"({TORCH_RANGE[0][0]}.{TORCH_RANGE[0][1]} to {TORCH_RANGE[1][0]}.{TORCH_RANGE[1][1]})", **info)
    try:
        available = torch.cuda.is_available()
        devices = torch.cuda.device_count() if available else 0
    except Exception as e:  # noqa: BLE001
        available, devices = False, 0
        info["device_error"] = f"{type(e).__name__}: {e}"
    info.update(available=available, devices=devices)
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else (f"HIP {info['hip']}" if info["hip"] else "CPU only")
    detail = f"torch {torch.__version__} ({build}), {devices} device(s) usable"
    if release > TORCH_RANGE[1]:
        return _result("warn", detail + f": newer than the newest release tested ({TORCH_RANGE[1][0]}.{TORCH_RANGE[1][1]})",
                       **info)
    if not available:
        return _result("warn", detail + ": no device, the device rows will not run", **info)
    return _result("ok", detail, **info)


def check_headers() -> Dict[str, Any]:
    try:
        from torch.utils import cpp_extension

        includes = cpp_extension.include_paths()
        libraries = cpp_extension.library_paths()
    except Exception as e:  # noqa: BLE001
        return _result("missing", f"torch.utils.cpp_extension does not answer ({type(e).__name__}: {e})")
    absent = [p for p in includes + libraries if not Path(p).is_dir()]
    if absent:
        return _result("missing", f"torch's C++ include or library directories are absent: {absent} (a torch "
                       "without its headers cannot build bagualu2._saves)")
    if not (Path(includes[0]) / "torch" / "headeronly" / "version.h").is_file():
        return _result("missing", f"{includes[0]}/torch/headeronly/version.h is absent: not a torch 2.11+ install")
    return _result("ok", f"headers {includes[0]}, libraries {libraries[0]}", include=includes, lib=libraries)


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def check_compiler(headers: Dict[str, Any]) -> Dict[str, Any]:
    cxx = _compiler()
    if cxx is None:
        return _result("missing", "no C++ compiler (CXX, c++, g++, clang++): install one with C++20 (GCC 10+)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()
    first = version[0] if version else cxx
    if headers["status"] != "ok":
        return _result("warn", f"{first}: not tried against torch's headers (they are missing)", cxx=cxx)
    try:
        import torch

        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    except Exception:  # noqa: BLE001
        abi = 1
    isystem = [arg for path in headers["include"] for arg in ("-isystem", path)]
    try:
        import sysconfig

        import pybind11 as pb

        isystem += ["-isystem", pb.get_include(), "-isystem", sysconfig.get_paths()["include"]]
    except ImportError:
        return _result("warn", f"{first}: not tried (pybind11 is missing)", cxx=cxx)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "probe.cpp"
        source.write_text(PROBE_SOURCE)
        start = time.monotonic()
        got = subprocess.run([cxx, "-std=c++20", "-fsyntax-only", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *isystem,
                              str(source)], capture_output=True, text=True, timeout=300)
    seconds = round(time.monotonic() - start, 1)
    if got.returncode != 0:
        return _result("missing", f"{first} does not compile C++20 against torch's headers: {got.stderr[-800:]}",
                       cxx=cxx)
    return _result("ok", f"{first}: C++20 against torch's headers in {seconds}s", cxx=cxx, seconds=seconds)


def _module(name: str) -> Optional[str]:
    try:
        imported = __import__(name)
    except ImportError:
        return None
    return f"{name} {getattr(imported, '__version__', '')}".strip()


def check_build_tools() -> Dict[str, Any]:
    """setup.py imports setuptools and pybind11, runs `cmake` from the PATH, and gives CMake the
    ninja of the `ninja` package where it imports (else CMake looks on the PATH)."""
    found, missing = {}, []
    for name in ("setuptools", "pybind11"):
        where = _module(name)
        found[name] = where
        if where is None:
            missing.append(name)
    found["cmake"] = shutil.which("cmake")
    if found["cmake"] is None:
        missing.append("cmake")
    found["ninja"] = _module("ninja") or shutil.which("ninja")
    if found["ninja"] is None:
        missing.append("ninja")
    if missing:
        return _result("missing", f"{', '.join(missing)} not found: there is no network here, so no build isolation; "
                       f"install them beside torch (pip install {' '.join(missing)}; cmake's script must be on the "
                       "PATH) before the device check", found=found)
    return _result("ok", ", ".join(f"{k}: {v}" for k, v in found.items()), found=found)


def check_saves(after_build: bool) -> Dict[str, Any]:
    built = {name: sorted(p.name for p in (ROOT / "bagualu2").glob(f"{name}.*.so")) for name in ("_C", "_saves")}
    if not after_build and not built["_C"]:
        return _result("ok", "not built yet: the build step builds _C and _saves in place", built=built)
    got = subprocess.run([sys.executable, "-c", SAVES_PROBE, str(ROOT)], capture_output=True, text=True, timeout=300,
                         cwd=tempfile.gettempdir(), env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        probe = json.loads(got.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return _result("missing" if after_build else "warn", f"the probe did not answer: {got.stderr[-800:]}")
    if "error" in probe:
        if not after_build:  # nothing built yet is what a fresh checkout has
            return _result("ok", f"not built yet ({probe['error'][:200]}): the build step builds _C and _saves",
                           probe=probe)
        return _result("missing", f"the in-place build does not import: {probe['error']}", probe=probe)
    if probe.get("save_path") == "compiled":
        return _result("ok", f"_saves loads under torch {probe['torch']} (built against its release)", probe=probe)
    if after_build:
        return _result("missing", f"_saves does not run: the save path runs in Python ({probe.get('reason')}); "
                       "the build did not build it against this torch", probe=probe)
    return _result("ok", f"_saves {probe.get('reason')}: the build step builds it against torch {probe['torch']}",
                   probe=probe)


CHECKS: List[str] = ["python", "torch", "headers", "compiler", "build-tools", "saves"]


def run(after_build: bool = False) -> Dict[str, Any]:
    """Every check's result, by name, in order."""
    results: Dict[str, Any] = {}
    timed: List[tuple] = [
        ("python", check_python), ("torch", check_torch), ("headers", check_headers),
        ("build-tools", check_build_tools),
    ]
    for name, check in timed:
        results[name] = _timed(check)
    results["compiler"] = _timed(lambda: check_compiler(results["headers"]))
    results["saves"] = _timed(lambda: check_saves(after_build))
    return {name: results[name] for name in CHECKS}


def _timed(check: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    start = time.monotonic()
    try:
        result = check()
    except Exception as e:  # noqa: BLE001 - a check that breaks is a finding, not a crash
        result = _result("missing", f"the check failed: {type(e).__name__}: {e}")
    result["seconds"] = round(time.monotonic() - start, 2)
    return result


def ok(results: Dict[str, Any]) -> bool:
    """Whether nothing the build and the checks need is missing (a warning passes)."""
    return all(r["status"] != "missing" for r in results.values())


def report(results: Dict[str, Any]) -> str:
    lines = [f"{name:12s} {r['status']:8s} {r['detail']}" for name, r in results.items()]
    missing = [name for name, r in results.items() if r["status"] == "missing"]
    lines.append("preflight: " + (f"MISSING {', '.join(missing)}" if missing else "ok"))
    return "\n".join(lines)


def dry_run() -> int:
    """The plan, and that each check runs here (exit 1 where one raises, not where one finds
    something missing: this machine need not be a device machine)."""
    print(__doc__.split("\n\n")[2])
    results = run(after_build=False)
    print(report(results))
    broken = [name for name, r in results.items() if r["detail"].startswith("the check failed")]
    if broken:
        print(f"dry run: the checks {broken} broke", file=sys.stderr)
        return 1
    print("dry run: every check ran")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--after-build", action="store_true", help="the in-place build must load, _saves included")
    p.add_argument("--dry-run", action="store_true", help="print the plan and run every check, whatever they find")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args(argv)
    if args.dry_run:
        return dry_run()
    results = run(after_build=args.after_build)
    print(report(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0 if ok(results) else 1


if __name__ == "__main__":
    sys.exit(main())
