"""``featcache doctor``: what this machine can do with featcache, one line per check (like
``lmdeploy check_env``), or one JSON document.

Each check says ``ok``, ``--`` (an optional part missing or unusable: what it would enable and
what to install) or ``FAIL`` (featcache's core cannot work: what to install). The exit code is 0
when the core works (Python, torch, lmdb, xxhash, numpy, and a put and get through a tiny cache
with a disk tier in a temporary directory), 1 otherwise; the optional parts never change it.

lmdeploy's engines are imported in child processes: their import takes seconds, prints warnings,
and a broken native module could take this process down with it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from .command import EXIT_ERROR, EXIT_OK, Command, json_argument

if TYPE_CHECKING:  # the rest is imported where used: the CLI's other commands start without it
    import subprocess

    from ..autosize import Budgets

OK, MISSING, FAIL = "ok", "--", "FAIL"
PROBE_TIMEOUT_S = 180  # an engine's import, in a child process


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, MISSING (optional) or FAIL (the core)
    detail: str  # what was found
    fix: str = ""  # what to install or do, when not ok
    required: bool = False  # part of featcache's core: a failure makes the exit code 1


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _package(name: str, dist: str, required: bool, install: str, enables: str) -> Check:
    version = _version(dist)
    try:
        importlib.import_module(name)
    except Exception as e:  # not installed, or broken
        found = "not installed" if version is None else f"{dist} {version} does not import: {e}"
        return Check(name, FAIL if required else MISSING, found + (f" ({enables})" if enables else ""),
                     install, required)
    return Check(name, OK, version or "installed", required=required)


def _python() -> Check:
    import platform

    version = platform.python_version()
    ok = sys.version_info >= (3, 10)
    return Check("python", OK if ok else FAIL, f"{version} ({sys.executable})",
                 "" if ok else "featcache needs Python 3.10 or later", required=True)


def _featcache() -> Check:
    from .._version import __version__

    where = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return Check("featcache", OK, f"{__version__} ({where})", required=True)


def _torch() -> list[Check]:
    try:
        import torch
    except Exception as e:
        return [Check("torch", FAIL, f"not installed or broken: {e}",
                      "pip install torch (a CUDA build for a GPU: https://pytorch.org)", True),
                Check("cuda", MISSING, "unknown (no torch)", "install torch first")]
    checks = [Check("torch", OK, torch.__version__, required=True)]
    if not torch.cuda.is_available():
        why = "torch has no CUDA" if torch.version.cuda is None else "no CUDA device visible"
        checks.append(Check("cuda", MISSING, f"not available: {why} (device tier on the CPU; "
                            "serve, warm and demo --device cuda need a GPU)",
                            "on a GPU machine: a CUDA build of torch, https://pytorch.org"))
        return checks
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        try:
            free, total = torch.cuda.mem_get_info(i)
            memory = f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
        except Exception:
            memory = f"{props.total_memory / 2**30:.1f} GiB"
        gpus.append(f"cuda:{i} {props.name}, {memory}")
    checks.append(Check("cuda", OK, f"CUDA {torch.version.cuda}; " + "; ".join(gpus)))
    return checks


def _core() -> Check:
    """A put and a get through a tiny cache with a disk tier, and back after a reopen."""
    import tempfile

    try:
        import torch

        from ..core.cache import FeatureCache

        with tempfile.TemporaryDirectory(prefix="featcache-doctor-") as where:
            value = torch.arange(16, dtype=torch.float32)
            options = dict(device="cpu", device_bytes="1MiB", host_bytes="1MiB",
                           disk_path=where, disk_bytes="16MiB")
            with FeatureCache(**options) as cache:  # type: ignore[arg-type]
                cache.put(b"doctor", value)
            with FeatureCache(**options) as cache:  # type: ignore[arg-type]
                got = cache.get(b"doctor")
            if got is None or not torch.equal(got, value):
                return Check("core", FAIL, "a value put was not read back from the disk tier",
                             "a bug in featcache: report it with `featcache doctor --json`", True)
    except Exception as e:
        return Check("core", FAIL, f"{type(e).__name__}: {e}",
                     "install what the lines above name (pip install featcache)", True)
    return Check("core", OK, "put, get and reopen of a cache with a disk tier", required=True)


def _probe(module: str) -> subprocess.Popen[str]:
    import subprocess

    return subprocess.Popen([sys.executable, "-c", f"import {module}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _probed(name: str, proc: subprocess.Popen[str] | None, enables: str, fix: str) -> Check:
    import subprocess

    if proc is None:
        return Check(name, MISSING, f"not checked: lmdeploy is not installed ({enables})", fix)
    try:
        _, err = proc.communicate(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return Check(name, MISSING, f"import took over {PROBE_TIMEOUT_S} s ({enables})", fix)
    if proc.returncode == 0:
        return Check(name, OK, "imports")
    lines = [line for line in err.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit code {proc.returncode}"
    return Check(name, MISSING, f"does not import: {last} ({enables})", fix)


def _lmdeploy() -> list[Check]:
    version = _version("lmdeploy")
    fix = "pip install 'featcache[lmdeploy]'"
    engines = (("lmdeploy.pytorch", "lmdeploy.pytorch.engine", "featcache.lmdeploy, serve and warm"),
               ("lmdeploy.turbomind", "lmdeploy.turbomind.turbomind", "the TurboMind backend"))
    probes = {name: (_probe(module) if version else None) for name, module, _ in engines}
    if version is None:
        head = Check("lmdeploy", MISSING, "not installed (featcache.lmdeploy, serve, warm)", fix)
    else:
        tested = version.startswith("0.18")
        head = Check("lmdeploy", OK if tested else MISSING,
                     version + ("" if tested else " (featcache is tested with 0.18)"),
                     "" if tested else "pip install 'lmdeploy==0.18.*'")
    checks = [head]
    for name, _, enables in engines:
        engine_fix = fix if name == "lmdeploy.pytorch" else (
            "lmdeploy's TurboMind wheel for your CUDA (pip install lmdeploy) and its dependencies")
        checks.append(_probed(name, probes[name], enables, engine_fix))
    return checks


def _store() -> Check:
    from ..config import ENV_DIR, default_store_dir
    from ..store.files import DATA_FILE, cannot_create, file_in_the_way, store_in_use

    path = default_store_dir()
    source = f" (from {ENV_DIR})" if os.environ.get(ENV_DIR) else ""
    why = cannot_create(path)
    if file_in_the_way(path) is not None:  # a file where the store, or a directory above it, would be
        return Check("store", MISSING, f"{path}{source}: {why}",
                     f"set {ENV_DIR} to a directory (a store, or where one may be created), or "
                     "pass --cache-dir / DIR")
    if os.path.isdir(path):
        writable = os.access(path, os.W_OK | os.X_OK)
        has_store = os.path.exists(os.path.join(path, DATA_FILE))
        holder = store_in_use(path) if has_store else 0
        broken = _broken(path, writable) if has_store and not holder else None
        if broken is not None:  # what stats and verify would say of it
            return Check("store", FAIL, f"{path}{source}: BROKEN: {broken}",
                         f"move it aside (a new store is made there), or set {ENV_DIR} / pass "
                         "--cache-dir to another directory")
        use = ("no store yet" if not has_store else
               f"in use by process {holder}" if holder else
               "not in use" if holder == 0 else "in use: unknown")
        detail = f"{path}: {'writable' if writable else 'NOT writable'}, {use}"
    else:
        writable = why is None
        detail = f"{path}: does not exist yet, " + ("can be created" if writable else
                                                     why.replace("cannot", "CANNOT", 1))
    return Check("store", OK if writable else MISSING, detail,
                 "" if writable else "set FEATCACHE_DIR to a directory you can write, or pass "
                 "--cache-dir / DIR")


def _broken(path: str, writable: bool) -> str | None:
    """Why the store at ``path`` cannot be read, as ``featcache stats`` would say it (a data file
    that is empty, not LMDB, truncated, of another format), or None."""
    from ..errors import FeatCacheError
    from ..storetools.view import StoreView

    try:
        with StoreView(path, lock=writable) as view:
            view.summary()
    except (FeatCacheError, OSError, ValueError) as e:
        return str(e)
    return None


def budgets() -> Budgets | None:
    """What ``budgets="auto"`` would give a serving cache here, now, over the default store
    (None without torch). A device tier on a GPU is decided once lmdeploy's engine reserved its
    KV cache: before any engine, the most it can be (``autosize.before_engine``)."""
    try:
        import torch  # noqa: F401
    except Exception:
        return None
    from .. import autosize
    from ..config import default_store_dir

    if not autosize.cuda_available():
        return autosize.decide(device="cpu", disk_path=default_store_dir())
    device = autosize.current_gpu()
    chosen = autosize.decide(device=device, disk_path=default_store_dir(), given={"device_bytes": 0})
    engine = autosize.EngineMemory(autosize.LMDEPLOY_KV_SHARE)
    return autosize.Budgets(chosen.mode, device,
                            (autosize.before_engine(device, engine), *chosen.choices[1:]))


def _budget_checks(chosen: Budgets | None) -> list[Check]:
    if chosen is None:
        return [Check("budgets", MISSING, "unknown (no torch)", "install torch first")]
    return [Check(f"budget.{c.tier}", OK, f"{c.size}: {c.reason}")
            for c in chosen.choices]


def checks(chosen: Budgets | None = None) -> list[Check]:
    """Every check, in the order printed; the last ones say what ``budgets="auto"`` chooses here
    (``chosen``, else ``budgets()``)."""
    found = [_python(), _featcache()]
    lmdeploy = _lmdeploy()  # its probes run in children meanwhile
    found += _torch()
    found += [
        _package("lmdb", "lmdb", True, "pip install lmdb", ""),
        _package("xxhash", "xxhash", True, "pip install xxhash", ""),
        _package("numpy", "numpy", True, "pip install numpy", ""),
        _core(),
        *lmdeploy,
        _package("redis", "redis", False, "pip install 'featcache[remote]'", "the remote tier"),
        _package("prometheus_client", "prometheus_client", False, "pip install 'featcache[metrics]'",
                 "metrics.register"),
        _package("PIL", "pillow", False, "pip install 'featcache[image]'", "image_key of PIL images"),
        _store(),
        *_budget_checks(chosen if chosen is not None else budgets()),
    ]
    return found


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    json_argument(p, "one JSON document instead of lines")


def _doctor(args: argparse.Namespace) -> int:
    chosen = budgets()
    found = checks(chosen)
    core_ok = all(c.status == OK for c in found if c.required)
    if args.json:
        print(json.dumps({"ok": core_ok, "checks": [asdict(c) for c in found],
                          "budgets": chosen.as_dict() if chosen is not None else None}, indent=2))
    else:
        width = max(len(c.name) for c in found)
        for c in found:
            line = f"{c.status:<4}  {c.name:<{width}}  {c.detail}"
            print(line + (f"; fix: {c.fix}" if c.fix and c.status != OK else ""))
        print("featcache's core works" if core_ok else
              "featcache's core does not work here: see the FAIL lines")
    return EXIT_OK if core_ok else EXIT_ERROR


DOCTOR = Command(
    "doctor", help="what this machine can do: Python, torch and CUDA, lmdeploy, lmdb, redis, store",
    description="Check the Python, featcache, torch and CUDA (devices and memory), lmdeploy (its "
    "PyTorch engine and TurboMind modules), lmdb, xxhash, numpy, redis, prometheus_client and "
    "Pillow, a put and get through a tiny cache, and the default store directory; then what "
    "--budgets auto would give each tier here and why. One line per check (ok, -- for an "
    "optional part missing, FAIL for the core) with what to install. Exit code 0 when "
    "featcache's core works, 1 otherwise.",
    add_arguments=_doctor_arguments, run=_doctor,
)
