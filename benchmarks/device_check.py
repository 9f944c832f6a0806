"""The device check, one command for a session lent a GPU: build, device-marked tests,
`bagualu2 selftest`, the offload bandwidth table; every number in one JSON.

    python benchmarks/device_check.py --out "$OUT"            # on the device machine
    python benchmarks/device_check.py --dry-run --out /tmp/x  # anywhere: plan and self-check

Steps (each with its own time limit, all within --budget-s; a step that would start with too
little time left is recorded as skipped, never silently dropped):
  1. environment   nvidia-smi -L, torch and its CUDA, bagualu2 backend status after the build
  2. build         python setup.py build_ext --inplace (BAGUALU2_BACKEND=auto, test hooks and
                   the stand-in driver included)
  3. gpu-path      pytest of the GPU path's test files (the stand-in driver's scenarios, arena,
                   engine, copy faults, facade, backends), their device-marked tests included:
                   on a GPU every test of issue #58 runs beside the real driver's
  4. tests         pytest -m cuda_only tests (every other device-marked test), with a JUnit
                   summary
  5. selftest      python -m bagualu2.cli selftest --out OUT/selftest (its JSON is written
                   before every row, so an abort still leaves the rows before it)
  6. bandwidth     benchmarks/offload_bandwidth.py, 64 MiB to 1 GiB, engine vs pinned torch
device_check.json is rewritten after every step. The output ends with one table (also in the
JSON as "summary"): the backend, the engine's copy GB/s and its ratio to torch's pinned copy
per size and direction, the overlap saved, exactness, the device>0 result and the tests'
counts; what did not run says so. --dry-run checks that every command, path and argument
parser of the plan exists and parses here, then records the plan without running it (exit 1
when a check fails).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
# Every step imports this checkout's bagualu2 (built in place), whatever the caller's path.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


# The GPU path's tests (issue #58): run whole on the device, device-marked tests included.
GPU_PATH_TESTS = ["tests/test_fake_driver.py", "tests/test_host_arena.py", "tests/test_copy_engine.py",
                  "tests/test_copy_faults.py", "tests/test_offload_facade.py", "tests/test_backends.py"]


def _steps(out: Path) -> List[Dict[str, Any]]:
    py = sys.executable
    return [
        # What the machine lacks (torch in range, its headers, a compiler, the build tools; no
        # network, so no build isolation) is named before anything is built.
        {"name": "preflight", "limit_s": 60,
         "cmd": [py, "benchmarks/device_preflight.py", "--json", str(out / "preflight.json")]},
        {"name": "build", "limit_s": 240,
         "cmd": [py, "setup.py", "-q", "build_ext", "--inplace"],
         "env": {"BAGUALU2_BACKEND": "auto", "MAX_JOBS": str(os.cpu_count() or 4)}},
        {"name": "saves", "limit_s": 60,
         "cmd": [py, "benchmarks/device_preflight.py", "--after-build", "--json", str(out / "saves.json")]},
        {"name": "gpu-path", "limit_s": 180,
         "cmd": [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GPU_PATH_TESTS,
                 f"--junitxml={out / 'gpu-path.xml'}"]},
        {"name": "tests", "limit_s": 180,
         "cmd": [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda_only", "tests",
                 *[f"--deselect={t}" for t in GPU_PATH_TESTS], f"--junitxml={out / 'tests.xml'}"]},
        {"name": "selftest", "limit_s": 480,
         "cmd": [py, "-m", "bagualu2.cli", "selftest", "--out", str(out / "selftest")]},
        {"name": "bandwidth", "limit_s": 120,
         "cmd": [py, "benchmarks/offload_bandwidth.py", "--min-size", "64M", "--max-size", "1G",
                 "--passes", "2", "--min-time", "0.1", "--quiet", "--no-plot",
                 "--out", str(out / "bandwidth")]},
    ]


def _environment() -> Dict[str, Any]:
    env: Dict[str, Any] = {"python": sys.version.split()[0], "root": str(ROOT)}
    smi = shutil.which("nvidia-smi")
    if smi:
        got = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
        env["nvidia_smi"] = got.stdout.strip() or got.stderr.strip()
    probe = ("import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
             "'available': torch.cuda.is_available(), 'devices': torch.cuda.device_count()}))")
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    env["torch"] = json.loads(got.stdout) if got.returncode == 0 else got.stderr[-500:]
    return env


def _attach(step: Dict[str, Any], out: Path) -> None:
    """The step's own JSON or summary, folded into its record."""
    name = step["name"]
    if name in ("tests", "gpu-path") and (out / f"{name}.xml").exists():
        suite = ET.parse(out / f"{name}.xml").getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        step["summary"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    elif name == "selftest" and (out / "selftest" / "selftest.json").exists():
        step["result"] = json.loads((out / "selftest" / "selftest.json").read_text())
    elif name == "bandwidth" and (out / "bandwidth.json").exists():
        step["result"] = json.loads((out / "bandwidth.json").read_text())


def _write(out: Path, doc: Dict[str, Any]) -> None:
    tmp = out / "device_check.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    tmp.replace(out / "device_check.json")


def _summary(doc: Dict[str, Any]) -> List[List[str]]:
    """The one table the run ends with: [check, result] rows, from the steps' records."""
    steps = {s["name"]: s for s in doc.get("steps", [])}
    selftest = steps.get("selftest", {}).get("result") or {}
    rows_by_name = {r["name"]: r for r in selftest.get("rows", [])}
    status = selftest.get("environment", {}).get("backend_status") or {}
    usable = [name for name, st in status.items() if st.get("usable") and name != "cpu"]
    table = [["backend", ", ".join(usable) or ("cpu only" if status else "not run")]]
    bandwidth = rows_by_name.get("bandwidth")
    for r in (bandwidth or {}).get("data", {}).get("rows", []):
        if "engine_GBps" in r:
            table.append([f"copy {r['bytes'] >> 20} MiB {r['direction']}",
                          f"{r['engine_GBps']:.1f} GB/s, {r['ratio']:.2f}x torch pinned "
                          f"({r['torch_pinned_GBps']:.1f} GB/s)"])
    if bandwidth is None:
        table.append(["copy GB/s", "not run"])
    overlap = rows_by_name.get("overlap")
    if overlap is not None and "saved_ms" in overlap.get("data", {}):
        d = overlap["data"]
        shorter = min(d["copy_ms"], d["compute_ms"])
        table.append(["overlap saved", f"{overlap['verdict']}: {d['saved_ms']:.1f} ms of the shorter "
                                       f"phase's {shorter:.1f} ms ({d['saved_ms'] / shorter:.0%})"])
    else:
        table.append(["overlap saved", overlap["verdict"] + ": " + overlap["detail"] if overlap else "not run"])
    for name in ("exact", "device>0"):
        row = rows_by_name.get(name)
        table.append([name, f"{row['verdict']}: {row['detail']}" if row else "not run"])
    for name, label in (("gpu-path", "gpu-path tests"), ("tests", "other device tests")):
        step = steps.get(name, {})
        got = step.get("summary")
        table.append([label, (f"{got['tests'] - got['failures'] - got['errors'] - got['skipped']} passed, "
                                        f"{got['failures'] + got['errors']} failed, {got['skipped']} skipped")
                      if got else step.get("status", "not run")])
    return table


def _print_summary(table: List[List[str]]) -> None:
    width = max(len(check) for check, _ in table)
    print(f"\n{'check':<{width}}  result")
    for check, result in table:
        print(f"{check:<{width}}  {result}")


def _dry_checks(steps: List[Dict[str, Any]]) -> List[str]:
    """What would make the real run fail before it measures anything."""
    problems = []
    for path in ("setup.py", "benchmarks/offload_bandwidth.py", "benchmarks/device_preflight.py", "tests/test_backends.py",
                 "tests/test_fake_driver.py", "tests/fake_driver/fake_cuda.cpp"):
        if not (ROOT / path).exists():
            problems.append(f"missing {path}")
    for path in GPU_PATH_TESTS:
        if not (ROOT / path).exists():
            problems.append(f"missing {path}")
    for args in (["benchmarks/device_preflight.py", "--dry-run"],
                 ["-m", "bagualu2.cli", "selftest", "--help"],
                 ["benchmarks/offload_bandwidth.py", "--help"],
                 ["-m", "pytest", "--co", "-q", "-m", "cuda_only", "tests/test_backends.py"],
                 ["-m", "pytest", "--co", "-q", *GPU_PATH_TESTS]):
        got = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env=ENV)
        if got.returncode != 0:
            problems.append(f"{' '.join(args)} failed: {got.stderr[-300:]}")
    return problems


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "device-check")))
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="wall-clock seconds for everything (default 420: the check twice in fifteen device minutes)")
    p.add_argument("--skip-build", action="store_true", help="use the extension already built")
    p.add_argument("--dry-run", action="store_true", help="check the plan here, run nothing")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    steps = _steps(args.out)
    if args.skip_build:
        steps = [s for s in steps if s["name"] != "build"]
    doc: Dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "dry_run": args.dry_run, "environment": _environment(), "steps": []}
    if args.dry_run:
        doc["problems"] = _dry_checks(steps)
        doc["steps"] = [{**s, "status": "planned"} for s in steps]
        doc["summary"] = _summary(doc)
        _write(args.out, doc)
        print(json.dumps({"problems": doc["problems"], "plan": [" ".join(s["cmd"]) for s in steps]}, indent=2))
        _print_summary(doc["summary"])
        return 1 if doc["problems"] else 0
    _write(args.out, doc)
    failed = False
    for step in steps:
        left = args.budget_s - (time.monotonic() - start)
        record: Dict[str, Any] = {"name": step["name"], "cmd": step["cmd"]}
        doc["steps"].append(record)
        if left < 30:
            record["status"] = f"skipped: {left:.0f} s left of --budget-s"
            failed = True
            _write(args.out, doc)
            continue
        t0 = time.monotonic()
        try:
            got = subprocess.run(step["cmd"], cwd=ROOT, capture_output=True, text=True,
                                 timeout=min(step["limit_s"], left), env={**ENV, **step.get("env", {})})
            record.update(rc=got.returncode, status="ok" if got.returncode == 0 else "failed",
                          output_tail=(got.stdout + got.stderr)[-3000:])
        except subprocess.TimeoutExpired as e:
            tail = (e.stdout or b"")[-3000:]
            record.update(rc=None, status=f"timed out after {min(step['limit_s'], left):.0f} s",
                          output_tail=tail.decode(errors="replace") if isinstance(tail, bytes) else tail)
        record["seconds"] = time.monotonic() - t0
        _attach(record, args.out)
        failed |= record["status"] != "ok"
        _write(args.out, doc)
        print(f"{record['name']:<10} {record['status']:<12} {record['seconds']:6.1f}s", flush=True)
        if step["name"] in ("preflight", "build", "saves") and record["status"] != "ok":
            break  # nothing after it runs on a machine that cannot build, or a failed build
    doc["backend_status"] = subprocess.run(
        [sys.executable, "-c", "import json, bagualu2; print(json.dumps(bagualu2.backend_status()))"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV).stdout.strip()
    doc["seconds"] = time.monotonic() - start
    doc["summary"] = _summary(doc)
    _write(args.out, doc)
    print(f"wrote {args.out / 'device_check.json'}")
    _print_summary(doc["summary"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
