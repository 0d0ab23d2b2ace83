"""Every module of the package imports alone, in a random order, each in a
process that imported nothing of bagua before (forked from a fresh
interpreter that only imported torch): a module that works only when
another was imported first (an import circle broken by luck) fails here.
And scripts/python_imports.py finds no import circle and no upward import."""

import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: forks one child per module, in the given order.
IMPORT_EACH_ALONE = r'''
import importlib, json, os, sys, traceback
import torch  # the children start from here, with nothing of bagua imported
assert not [m for m in sys.modules if m == "bagua" or m.startswith("bagua.")]
failures = {}
for name in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        message = b"ok"
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:  # a third-party package not installed is not ours
            if (error.name or "").split(".")[0] == "bagua":
                message = traceback.format_exc().encode()
        except BaseException:
            message = traceback.format_exc().encode()
        os.write(write, message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        report = pipe.read().decode(errors="replace")
    os.waitpid(pid, 0)
    if report != "ok":
        failures[name] = report or "the child died without a report"
print(json.dumps(failures))
'''


def _modules():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "python_imports.py"), "--modules"],
                         check=True, capture_output=True, text=True).stdout
    return out.split()


def test_every_module_imports_alone_in_random_order():
    names = _modules()
    assert "bagua.torch_api.data_parallel.hooks" in names and "bagua.torch_api.algorithms.base" in names
    seed = random.randrange(1 << 30)
    random.Random(seed).shuffle(names)
    result = subprocess.run([sys.executable, "-c", IMPORT_EACH_ALONE, json.dumps(names)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    failures = json.loads(result.stdout.strip().splitlines()[-1])
    assert not failures, f"order seed {seed}: " + "\n".join(f"{n}:\n{r}" for n, r in failures.items())


def test_no_import_circle_and_layers_point_down():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "python_imports.py"), "--cycles", "--layers"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_meson_installs_every_algorithm_module():
    """algorithms/ is installed file by file (meson.build): a module missing
    from that list imports from the source tree but not once installed."""
    import re
    listed = set(re.findall(r"'algorithms/([\w]+\.py)'", (ROOT / "meson.build").read_text()))
    present = {p.name for p in (ROOT / "algorithms").glob("*.py")}
    assert present - listed == set(), f"add to meson.build's py.install_sources: {sorted(present - listed)}"
