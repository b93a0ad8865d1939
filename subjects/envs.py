"""Cached virtual environments for third-party subjects (verl, HF/TRL, ...), never the main venv.

    from subjects.envs import EnvSpec, ensure
    python = ensure(EnvSpec("verl-0.6.1", requirements=(...), no_deps=("verl==0.6.1",)))

``ensure`` returns the environment's python, building it first if this machine has none: one
folder per spec under ``~/.cache/llm-parity/envs`` (``$LLM_PARITY_ENVS`` to move it), named
``<name>-<hash>`` where the hash covers everything that decides its contents (requirements,
no-deps packages, constraints, python version), so an edited list builds a new one and an old
one is never silently reused. Built once per machine, then reused as it is.

The build is atomic: a fresh venv in a temporary folder beside the target, ``pip install`` of the
requirements under a constraints file (``torch==2.13.0`` by default, so no dependency can pull
another torch, such as a multi-GB CUDA one), then the ``no_deps`` packages with ``--no-deps``, a
check that the pins hold, a manifest (``llm-parity-env.json``: the spec, ``pip freeze``, the build
time), and only then a rename to the target. A failed or interrupted build leaves no target, and
a lock file serialises builders of one spec (two pytest sessions, say). Because the folder is
renamed after it is built, the console scripts in ``bin/`` carry the temporary path in their
``#!`` line: always run ``python -m ...`` (``python -m torch.distributed.run``, not ``torchrun``).

When the package index cannot be reached, ``ensure`` raises ``EnvUnavailable`` with pip's own
network error as the reason (tests skip with it); any other failure is ``EnvBuildError`` with the
tail of pip's output. The decision is taken from pip's output, never guessed in advance. ``pip``
runs any pip command under the same rule.

``clone(python, dest)`` makes a fresh venv whose site-packages holds hard links to a built
environment's: a user's environment with, say, a multi-GB torch in it, made in a second and
without disk, for a test to install into. The cached environment stays as it was: pip removes
or replaces an installed file (a new inode in the clone), never writes into one.

A spec with a ``base`` is built that way: its base environment (built first where missing) is
cloned, and only the spec's own packages are installed into the clone, so the environments
that share torch and a stack's common packages (verl's three, TRL's, an HF one) unpack and
resolve those once per machine.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TORCH = "torch==2.13.0"
ROOT_VARIABLE = "LLM_PARITY_ENVS"
MANIFEST = "llm-parity-env.json"
_FORMAT = 1  # bump when the build itself changes in a way that changes what it makes

# pip's words when it could not talk to the index (urllib3/requests errors it prints while retrying)
_NETWORK = re.compile(
    r"Failed to establish a new connection|Temporary failure in name resolution|"
    r"Name or service not known|Network is unreachable|No route to host|Connection refused|"
    r"Connection reset by peer|ConnectTimeoutError|ReadTimeoutError|ProxyError|"
    r"Could not fetch URL|SSLError|Max retries exceeded|connection broken by"
)


class EnvUnavailable(RuntimeError):
    """The package index could not be reached, so the environment cannot be built here."""


class EnvBuildError(RuntimeError):
    """pip failed for another reason than the network (a conflict, a missing version...)."""


@dataclass(frozen=True)
class EnvSpec:
    """What goes into one environment.

    requirements: installed together with their dependencies, under ``constraints``.
    no_deps: installed afterwards with ``--no-deps`` (a package whose declared dependencies pull
        far more than the code path in use imports; list what it needs in ``requirements``).
    constraints: pins no dependency may move (``torch==2.13.0``), with every base's.
    base: an environment this one starts from (a hard-linked clone), its pins held as well.
    """

    name: str
    requirements: tuple[str, ...] = ()
    no_deps: tuple[str, ...] = ()
    constraints: tuple[str, ...] = (TORCH,)
    base: EnvSpec | None = None  # cloned, then this spec's packages installed into the clone

    def chain(self) -> list[EnvSpec]:
        """This spec and its bases, itself first."""
        return [self, *(self.base.chain() if self.base is not None else [])]

    def key(self) -> str:
        payload = {
            "format": _FORMAT,
            "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
            **asdict(self),
        }
        text = json.dumps(payload, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def folder_name(self) -> str:
        return f"{self.name}-{self.key()}"


#: the environment every torch-2.13.0 subject's starts from (``EnvSpec.base``): torch unpacked once
TORCH_BASE = EnvSpec("torch-2.13.0", requirements=(TORCH,))


def root() -> Path:
    return Path(os.environ.get(ROOT_VARIABLE) or "~/.cache/llm-parity/envs").expanduser()


def python_of(env: Path) -> Path:
    return env / "bin" / "python"


def find(spec: EnvSpec, where: Path | None = None) -> Path | None:
    """The python of the spec's environment if it is built on this machine, else None."""
    py = python_of((where or root()) / spec.folder_name())
    return py if py.exists() else None


def ensure(spec: EnvSpec, where: Path | None = None, *, timeout_s: float = 3600) -> Path:
    """The python of the spec's environment, built first if this machine has none (its base
    first, where it has one)."""
    base = where or root()
    base.mkdir(parents=True, exist_ok=True)
    target = base / spec.folder_name()
    if python_of(target).exists():
        return python_of(target)
    if spec.base is not None:
        ensure(spec.base, base, timeout_s=timeout_s)  # outside this spec's lock: its own
    with (base / f".{spec.folder_name()}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if python_of(target).exists():  # another process built it meanwhile
            return python_of(target)
        for stale in base.glob(f".{spec.folder_name()}.*"):  # a build killed half-way
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.folder_name()}.", dir=base))
        tmp.chmod(0o755)  # mkdtemp makes it private; the built env is an ordinary folder
        try:
            _build(spec, tmp, timeout_s, base)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return python_of(target)


def _retries() -> str:
    """pip's --retries, at least 1: a connection error is only printed when pip retries."""
    try:
        return str(max(1, int(os.environ.get("PIP_RETRIES") or 5)))
    except ValueError:
        return "5"


def pip(py: Path, args: list[str], log: Path, timeout_s: float) -> None:
    """`py -m pip ARGS`, its output appended to `log`; EnvUnavailable when pip could not reach
    the package index, EnvBuildError with pip's last lines for any other failure."""
    cmd = [str(py), "-m", "pip", "--disable-pip-version-check", "--no-input"]
    cmd += ["--retries", _retries(), *args]
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s
        )
        f.write(proc.stdout)
    if proc.returncode == 0:
        return
    lines = proc.stdout.splitlines()
    network = [line.strip() for line in lines if _NETWORK.search(line)]
    if network:
        raise EnvUnavailable(f"cannot reach the package index (pip: {network[-1][:300]})")
    tail = "\n".join(lines[-20:])
    raise EnvBuildError(f"pip {' '.join(args[:1])} failed (exit {proc.returncode}):\n{tail}")


def _build(spec: EnvSpec, env: Path, timeout_s: float, where: Path) -> None:
    started = time.monotonic()
    if spec.base is not None:
        clone(python_of(where / spec.base.folder_name()), env)
    else:
        base_python = getattr(sys, "_base_executable", None) or sys.executable
        subprocess.run([base_python, "-m", "venv", str(env)], check=True, timeout=600)
    py = python_of(env)
    log = env / "build.log"
    constraints = env / "constraints.txt"
    pins = dict.fromkeys(c for layer in spec.chain() for c in layer.constraints)
    constraints.write_text("".join(f"{c}\n" for c in pins))
    install = ["install", "-c", str(constraints)]
    if spec.requirements:
        requirements = env / "requirements.txt"
        requirements.write_text("".join(f"{r}\n" for r in spec.requirements))
        pip(py, [*install, "-r", str(requirements)], log, timeout_s)
    if spec.no_deps:
        pip(py, [*install, "--no-deps", *spec.no_deps], log, timeout_s)
    freeze = subprocess.run(
        [str(py), "-m", "pip", "freeze", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout.splitlines()
    _check_pins(spec, freeze)
    manifest = {
        "spec": asdict(spec),
        "key": spec.key(),
        "python": sys.version.split()[0],
        "build_seconds": round(time.monotonic() - started, 1),
        "freeze": freeze,
    }
    (env / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def site_packages(env: Path) -> Path:
    """The site-packages folder of the venv at `env` (lib/pythonX.Y/site-packages)."""
    found = sorted((env / "lib").glob("python*/site-packages"))
    if len(found) != 1:
        raise EnvBuildError(f"{env}: expected one lib/python*/site-packages, found {len(found)}")
    return found[0]


def clone(python: Path, dest: Path) -> Path:
    """A fresh venv at `dest` holding the packages of the environment whose python is `python`,
    as hard links (module doc); returns its python. `dest` must be on the environment's
    filesystem (a hard link cannot cross one): EnvBuildError names both otherwise."""
    env = Path(python).parent.parent
    source = site_packages(env)
    subprocess.run([str(python), "-m", "venv", "--without-pip", str(dest)], check=True, timeout=600)
    target = site_packages(dest)
    if source.stat().st_dev != target.stat().st_dev:
        shutil.rmtree(dest, ignore_errors=True)
        raise EnvBuildError(f"{dest}: not on the filesystem of {env}; clone it beside that")
    shutil.rmtree(target)
    shutil.copytree(source, target, symlinks=True, copy_function=os.link)
    return python_of(dest)


def _check_pins(spec: EnvSpec, freeze: list[str]) -> None:
    """Every `name==version` of the spec is what got installed (a local label such as +cpu
    aside)."""
    installed = {}
    for line in freeze:
        if "==" in line:
            name, version = line.split("==", 1)
            installed[_canonical(name)] = version.split("+", 1)[0]
    layers = spec.chain()  # a base's pins hold in every environment cloned from it
    asked = [(pin, True) for layer in layers for pin in (*layer.requirements, *layer.no_deps)]
    asked += [(pin, False) for layer in layers for pin in layer.constraints]  # need not be there
    for pin, required in asked:
        if "==" not in pin:
            continue
        name, version = pin.split("==", 1)
        got = installed.get(_canonical(name.split("[", 1)[0]))
        if (got is None and required) or (got is not None and got != version.split("+", 1)[0]):
            raise EnvBuildError(f"{pin}: installed {got or 'nothing'}")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
