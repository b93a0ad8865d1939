"""Job and pair specs: what to run under torchrun, validated up front with one-line errors.

A bad spec should fail before any process starts, with a message that names the key and the
file, not deep inside a worker on rank 3.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:  # a machine's own packages (a GPU box): YAML and code specs only
        tomllib = None  # type: ignore[assignment]

import yaml

from parity import tasks
from parity.errors import SpecError
from parity.secrets import masked_env  # re-exported: the spec's own name for it
from parity.tasks import CUSTOM

if TYPE_CHECKING:
    from parity.judge.policy import Policy

TABLES = ("a", "b", "policies", "read", "check")  # a spec file's tables beside the job's keys
LAUNCHER_KINDS = ("local", "slurm")
#: how check and bisect read each side's run folder: read_metrics' and compare's options
READ_OPTIONS = {
    "format": None, "run": None, "duplicates": "error", "allow_skipped": False,
    "at_source_precision": False,
}  # fmt: skip

Scalar = str | int | float | bool

__all__ = [
    "JobSpec", "LauncherSpec", "PairSpec", "SpecError", "format_scalar", "load_policies",
    "load_read_options", "load_spec", "masked_env", "require_choice", "require_flags",
    "require_int", "load_check_options", "check_read_options", "read_keywords",
]  # fmt: skip


@dataclass(frozen=True)
class LauncherSpec:
    """Where a job's torchruns run: this machine (``local``, the default) or a Slurm cluster
    (``slurm``, parity.run.slurm), as the spec's ``[launcher]`` table gives it.

    With slurm, one ``sbatch`` allocation of ``nodes`` nodes (default: the job's nnodes) runs
    every side one after the other on the same nodes, one torchrun per node
    (``ntasks_per_node`` 1: its --nproc-per-node is the ranks per node); ``parallel`` submits
    each side as a job of its own instead, at once, on whatever nodes Slurm gives it.
    """

    kind: str = "local"
    nodes: int | None = None
    ntasks_per_node: int = 1
    partition: str | None = None
    time: str | None = None  # Slurm's own time format, e.g. "00:20:00"
    sbatch_args: tuple[str, ...] = ()
    srun_args: tuple[str, ...] = ()
    parallel: bool = False
    max_pending_s: float = 600.0  # an allocation pending longer is cancelled: failed
    poll_s: float = 0.5  # how often the harness looks at the shared folder
    visible_s: float = 60.0  # a running allocation's first file must appear here by then

    def __post_init__(self) -> None:
        require_choice("launcher kind", self.kind, LAUNCHER_KINDS)
        require_int("launcher nodes", self.nodes, minimum=1, optional=True)
        require_int("launcher ntasks_per_node", self.ntasks_per_node, minimum=1)
        if self.ntasks_per_node != 1:
            raise SpecError("launcher ntasks_per_node must be 1: one torchrun per node, whose "
                            "--nproc-per-node is the job's ranks per node")  # fmt: skip
        for name in ("partition", "time"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SpecError(f"launcher {name} must be a non-empty string, got {value!r}")
        for name in ("sbatch_args", "srun_args"):
            given = _str_list(f"launcher {name}", getattr(self, name))
            object.__setattr__(self, name, tuple(given))
        if not isinstance(self.parallel, bool):
            raise SpecError(f"launcher parallel must be true or false, got {self.parallel!r}")
        for name in ("max_pending_s", "poll_s", "visible_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e9:
                raise SpecError(f"launcher {name} must be a number of seconds > 0, got {value!r}")
        _refuse_nul(self.to_dict(), "launcher.")
        if self.kind == "local":
            given = [k for k, v in self.to_dict().items() if k != "kind"]
            if given:
                raise SpecError(f'launcher {", ".join(given)}: only for kind = "slurm"')

    @classmethod
    def from_value(cls, value: object) -> LauncherSpec:
        """From a spec's ``[launcher]`` table (or ``"slurm"``, ``--launcher slurm``)."""
        if isinstance(value, LauncherSpec):
            return value
        if isinstance(value, str):
            value = {"kind": value}
        if not isinstance(value, Mapping):
            raise SpecError(f'launcher must be a table (kind = "slurm", ...), got {value!r}')
        valid = tuple(f.name for f in dataclasses.fields(cls))
        for key in value:
            if key not in valid:
                _unknown(key, "[launcher]", valid)
        return cls(**{str(k): v for k, v in value.items()})

    def to_dict(self) -> dict[str, Any]:
        """The keys that differ from the defaults (a local launcher: ``{}``)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "kind" or value != f.default:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return {} if out == {"kind": "local"} else out


@dataclass(frozen=True, init=False)
class JobSpec:
    """One torchrun job: what every job has, plus the keys of its task's preset (``options``).

    ``task`` is "custom" (run ``command``) or a preset a package registers (parity.tasks), whose
    own keys are given beside these, ``JobSpec(task="charcount-sft", trainer="legacy")``, kept in
    ``options`` with the preset's defaults filled in, and read as attributes (``spec.trainer``).
    ``to_args`` turns it into the torchrun arguments for ``parity.run.launch``.
    """

    task: str = CUSTOM
    command: list[str] | None = None  # "custom" only; `{out}` -> the run folder
    world_size: int = 1
    nnodes: int = 1
    distributed: bool = True  # False: one plain process; world_size N > 1: the ranks it starts
    steps: int = 20
    seed: int = 0
    timeout_s: float = 600.0
    stall: float | str = "auto"  # no new step for this long: a hang (parity.run.stall)
    torchrun_args: list[str] = field(default_factory=list)
    inject: list[str] = field(default_factory=list)  # names of mutants to apply
    preload: list[str] | None = None  # imported by a fast path's warm ranks; None: the preset's
    env: dict[str, str] = field(default_factory=dict)  # variables the job runs with
    launcher: LauncherSpec = field(default_factory=LauncherSpec)  # where the torchruns run
    options: dict[str, Any] = field(default_factory=dict)  # the preset's own keys

    def __init__(
        self,
        task: str = CUSTOM,
        command: list[str] | None = None,
        world_size: int = 1,
        nnodes: int = 1,
        distributed: bool = True,
        steps: int = 20,
        seed: int = 0,
        timeout_s: float = 600.0,
        torchrun_args: list[str] | tuple[str, ...] = (),
        inject: list[str] | tuple[str, ...] = (),
        preload: list[str] | tuple[str, ...] | None = None,
        env: Mapping[str, Any] | None = None,
        launcher: LauncherSpec | Mapping[str, Any] | str | None = None,
        options: Mapping[str, Any] | None = None,
        stall: float | str = "auto",
        **keys: Any,
    ) -> None:
        given = dict(locals())
        for name in _FIELDS:
            object.__setattr__(self, name, given[name])
        preset = tasks.get(task) if isinstance(task, str) else None
        known = dict(preset.keys) if preset is not None else {}
        chosen = {**(options or {}), **keys}
        for key in chosen:
            if key not in known:
                _unknown(key, f"a {task!r} spec", _valid_keys(task))
        merged = {k: _plain(v) for k, v in {**known, **chosen}.items()}
        object.__setattr__(self, "options", merged)
        object.__setattr__(self, "env", {} if env is None else env)
        object.__setattr__(self, "launcher", LauncherSpec() if launcher is None else launcher)
        self.__post_init__()

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task:
            raise SpecError(f"task must be a non-empty string, got {self.task!r}")
        for name in ("world_size", "steps", "nnodes"):
            require_int(name, getattr(self, name), minimum=1)
        require_int("seed", self.seed)
        if not isinstance(self.distributed, bool):
            raise SpecError(f"distributed must be true or false, got {self.distributed!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float):
            raise SpecError(f"timeout_s must be a number, got {self.timeout_s!r}")
        if not self.timeout_s > 0 or self.timeout_s == float("inf"):  # nan would never time out
            raise SpecError(f"timeout_s must be > 0 and finite, got {self.timeout_s}")
        _check_stall(self.stall)
        if self.world_size % self.nnodes:
            raise SpecError(f"world_size {self.world_size} is not divisible by nnodes "
                            f"{self.nnodes}")  # fmt: skip
        object.__setattr__(self, "inject", _str_list("inject", self.inject))
        object.__setattr__(self, "torchrun_args", _str_list("torchrun_args", self.torchrun_args))
        object.__setattr__(self, "env", _env(self.env))
        object.__setattr__(self, "launcher", LauncherSpec.from_value(self.launcher))
        if not self.distributed:
            self._check_plain()
        _refuse_nul({n: getattr(self, n) for n in _FIELDS if n not in ("launcher", "options")})
        _refuse_nul(self.options)
        if (self.launcher.nodes or self.nnodes) < self.nnodes:
            raise SpecError(f"launcher nodes {self.launcher.nodes} is fewer than the job's nnodes "
                            f"{self.nnodes}")  # fmt: skip
        preset = self.preset
        default = list(preset.preload) if preset is not None else []
        object.__setattr__(self, "preload", _module_names("preload", self.preload, default))
        if preset is None:
            if self.command is None or len(self.command) == 0:
                raise SpecError("task 'custom' needs a command (module or script args)")
            object.__setattr__(self, "command", _str_list("command", self.command))
        else:
            if self.command is not None:
                raise SpecError(f"command is only used by task 'custom', not {self.task!r}")
            if preset.check is not None:
                preset.check(self)

    def __getattr__(self, name: str) -> Any:
        """A preset's key as an attribute: ``spec.trainer``."""
        options = self.__dict__.get("options")
        if not name.startswith("__") and options is not None and name in options:
            return options[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def preset(self) -> tasks.Task | None:
        """The task's preset (parity.tasks), None for "custom"."""
        return tasks.get(self.task)

    @property
    def variant(self) -> str:
        """What tells this side from the other in a preset's pair (its side key's value, e.g. the
        trainer); '' for a custom command."""
        preset = self.preset
        if preset is None or preset.side_key is None:
            return ""
        return str(self.options.get(preset.side_key, ""))

    def _check_plain(self) -> None:
        """``distributed = false``: one plain process, ``python COMMAND``, on one node; with
        world_size N > 1 it starts its own N ranks (Ray's workers, processes of its own), which
        must form one group of N (parity.run.world)."""
        if self.torchrun_args:
            raise SpecError(
                f"distributed = false runs one plain process, without torchrun: torchrun_args "
                f"{self.torchrun_args} would not be used"
            )
        if self.nnodes != 1:
            raise SpecError(
                f"distributed = false runs one plain process on one node: nnodes must be 1, "
                f"got {self.nnodes}"
            )
        if self.world_size > 1 and self.launcher.kind == "slurm":
            raise SpecError(
                f"distributed = false with world_size {self.world_size} (one plain process that "
                f"starts its own ranks) runs only with the local launcher: a Slurm step starts "
                f"torchrun, whose ranks would be counted with the job's own"
            )

    @property
    def nproc_per_node(self) -> int:
        """The processes the launcher starts per node: world_size / nnodes, or 1 for a job that
        is not distributed (its ranks, if any, are its own)."""
        return self.world_size // self.nnodes if self.distributed else 1

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "spec") -> JobSpec:
        """Build from parsed TOML/YAML; errors mention ``source`` (e.g. the file name)."""
        _reject_unknown(data, source)
        try:
            return cls(**{str(k): v for k, v in data.items()})
        except SpecError as e:
            raise SpecError(f"{source}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict, the preset's keys beside the others (secrets included: what
        rebuilds the spec with ``from_dict``)."""
        out = {name: copy.deepcopy(getattr(self, name)) for name in _FIELDS if name != "options"}
        launcher = out.pop("launcher").to_dict()  # a local job's dict has no launcher key
        if launcher:
            out["launcher"] = launcher
        return {**out, **copy.deepcopy(self.options)}

    def shown(self) -> dict[str, Any]:
        """``to_dict`` as summaries and `parity spec` show it: secrets in env masked."""
        return {**self.to_dict(), "env": masked_env(self.env)}

    def replace(self, **changes: Any) -> JobSpec:
        """A copy with ``changes`` (any keys, the preset's included), validated."""
        return dataclasses.replace(self, **changes)

    def to_args(self, out_dir: Path) -> list[str]:
        """torchrun's arguments after its own: the command, ``{out}`` made the run folder; or
        the preset's (``["-m", "worker.sft", "--trainer", "worker", ...]``)."""
        preset = self.preset
        if preset is None:
            assert self.command is not None
            args = [a.replace("{out}", str(out_dir)) for a in self.command]
        else:
            args = list(preset.args(self, Path(out_dir)))
        if self.inject:  # mutants are applied by parity.rank.mutants in every rank, before the job
            args = ["-m", "parity.rank.mutants", "--mutants", ",".join(self.inject), *args]
        return args


@dataclass(frozen=True)
class PairSpec:
    """Two jobs that should agree: ``base`` with the ``a`` overrides vs with the ``b`` overrides.

    Overrides replace whole fields (``overrides``/``inject`` included, no merging).
    """

    base: JobSpec
    a: dict[str, Any] = field(default_factory=dict)
    b: dict[str, Any] = field(default_factory=dict)
    source: str = field(default="", compare=False)  # file it came from, for error messages

    def __post_init__(self) -> None:
        a, b = self.sides()  # validate both sides now, not when the pair is run
        if a.launcher != b.launcher:
            raise SpecError(
                f"the two sides{' of ' + self.source if self.source else ''} must "
                "run on one launcher ([launcher] is the pair's, not a side's)"
            )

    @classmethod
    def from_variants(cls, base: JobSpec, a: str, b: str) -> PairSpec:
        """The usual pair of a preset: the same job with its side key (e.g. the trainer) set to
        ``a`` on one side and ``b`` on the other."""
        preset = base.preset
        if preset is None or preset.side_key is None:
            raise SpecError(
                f"task {base.task!r} has no side key to set to {a!r} and {b!r}; give each side's "
                "keys instead ([a] and [b] tables, --a KEY=VALUE)"
            )
        return cls(base, {preset.side_key: a}, {preset.side_key: b})

    def sides(self) -> tuple[JobSpec, JobSpec]:
        """The two jobs, each ``base`` with its overrides applied and validated."""
        where = f" of {self.source}" if self.source else ""
        return (_apply(self.base, self.a, f"[a]{where}"), _apply(self.base, self.b, f"[b]{where}"))

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base.to_dict(), "a": dict(self.a), "b": dict(self.b)}


#: `parity spec --example`: every key with its default, as a commented spec to start from
EXAMPLE = """\
# A job spec for `parity pair --spec`, `parity check --spec` and `parity bisect --spec`.
# Every key is optional; the values shown are the defaults. Keys at the top level describe the
# job both sides run; the [a] and [b] tables override keys for one side only (a whole value
# each: a table such as env or overrides is replaced, not merged).

task = "custom"            # "custom": run `command`; or a preset an installed package
                           # registers (`parity tasks` lists them, with their own keys)
command = ["train.py", "--output_dir", "{out}", "--max_steps", "20"]
                           # custom only: a script (or "-m", "module") and its arguments, run as
                           # `torchrun ... COMMAND` (not distributed: `python COMMAND`); {out} is
                           # the run folder, empty at start
world_size = 2             # ranks in all (default 1); must form one process group
nnodes = 1                 # torchrun nodes (all on this machine); world_size / nnodes per node
distributed = true         # false: one plain process, no torchrun (no torch needed); with
                           # world_size N > 1 it starts its own N ranks (Ray workers, processes
                           # given RANK and WORLD_SIZE), which must form one group of N
steps = 20                 # what progress counts to (presets: the steps they train)
seed = 0
timeout_s = 600.0          # per run; the run is killed and reported as failed after it
stall = "auto"             # no new step written for this long: killed as hung (failed), each
                           # rank's stack named; "auto": 5x the slowest step, at least 120 s,
                           # from the first step on; seconds; or "off" (the timeout alone)
torchrun_args = []         # extra torchrun flags, e.g. ["--master-port", "29600"]
inject = []                # mutants applied before the job starts (`parity mutants`)
preload = []               # modules the job imports first thing, in its order, that the fast
                           # paths (--in-process, pytest's pools) import once before forking it
                           # (a preset's default: its own; see docs/spec.md)
# a preset's own keys go here too, e.g. trainer = "legacy" (`parity tasks` lists them)

[env]                      # variables the job runs with (both sides; [a.env]/[b.env] per side)
ACCELERATE_USE_CPU = "true"
OMP_NUM_THREADS = "1"

[launcher]                 # where the torchruns run (--launcher slurm sets kind)
kind = "local"             # "local": this machine; "slurm": one sbatch allocation, from here
# nodes = 2                # slurm: the allocation's nodes (default: nnodes)
# ntasks_per_node = 1      # one torchrun per node; its --nproc-per-node is world_size / nnodes
# partition = "debug"
# time = "00:20:00"        # the allocation's time limit, in Slurm's format
# sbatch_args = ["--exclusive"]
# srun_args = []
# parallel = false         # true: each side a job of its own, at once, on any nodes (then
#                          # only a tolerance verdict is meaningful)
# max_pending_s = 600.0    # an allocation pending longer is cancelled: failed (exit 3)
# poll_s = 0.5             # how often the harness looks at the shared run folders
# visible_s = 60.0         # a running job's first file must appear here by then (shared FS)

[policies]                 # per metric (globs allowed): exact, ulp:K, close:RTOL,ATOL, ignore
"train/loss" = "exact"
"eval/*" = "ulp:2"

[read]                     # how check and bisect read each side's run folder
# format = "hf-trainer-state"   # default: detected (see `parity compare --help`)
# run = "NAME"                  # the run to read in a folder holding several
duplicates = "error"       # a step logged twice with other values: error, first or last
allow_skipped = false      # compare although a reader skipped records it could not use
at_source_precision = false  # judge a rounded log at its decimals (else: verdict imprecise)

[check]                    # check and bisect: what each revision's worktree gets besides its tree
carry = []                 # paths git ignores, copied read-only from your checkout into every
                           # worktree, e.g. ["data/shakespeare_char/train.bin", "data/tok/"]

[b]                        # side b only (pair); check and bisect run one job on two revisions
env = { ACCELERATE_USE_CPU = "true", MY_FLAG = "new" }
"""


def load_spec(path: str | Path) -> JobSpec | PairSpec:
    """Read a ``.toml`` or ``.yaml``/``.yml`` spec: job keys at top level, optional a/b tables
    (and optional ``policies`` and ``read`` tables, read by ``load_policies`` and
    ``load_read_options``)."""
    source = str(path)
    data = _read_spec(Path(path))
    _reject_unknown(data, source, TABLES)
    for table in ("policies", "read", "check"):
        data.pop(table, None)
    a, b = data.pop("a", None), data.pop("b", None)
    base = JobSpec.from_dict(data, source)
    if a is None and b is None:
        return base
    sides = {}
    for name, table in (("a", a), ("b", b)):
        if table is None:
            table = {}
        if not isinstance(table, dict):
            raise SpecError(f"{source}: [{name}] must be a table, got {type(table).__name__}")
        sides[name] = table
    return PairSpec(base, sides["a"], sides["b"], source=source)


_TOML_ERROR = tomllib.TOMLDecodeError if tomllib is not None else OSError  # OSError: caught anyway


def _read_spec(path: Path) -> dict[str, Any]:
    """The parsed file as a dict; unreadable or non-table content is a one-line SpecError."""
    source = str(path)
    try:
        if path.suffix == ".toml":
            if tomllib is None:
                raise SpecError(f"{source}: reading TOML on Python 3.10 needs tomli (pip install "
                                "tomli), or write the spec as .yaml")  # fmt: skip
            with open(path, "rb") as f:
                data = tomllib.load(f)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(path.read_text())
        else:
            raise SpecError(f"{source}: unsupported spec format {path.suffix!r} (.toml or .yaml)")
    except (OSError, _TOML_ERROR, yaml.YAMLError, RecursionError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecError(f"{source}: cannot read spec: {first}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{source}: spec must be a table of keys, got {type(data).__name__}")
    return data


def load_policies(path: str | Path) -> dict[str, Policy]:
    """The spec's ``[policies]`` table, METRIC (or glob) = POLICY text, each checked by parsing.

    Policies live with the job so that ``check``/``bisect``/``pair --spec`` judge the same way
    every time; ``--policy`` flags on the command line override them per metric.
    """
    from parity.judge.policy import Policy

    table = _read_spec(Path(path)).get("policies", {})
    if not isinstance(table, dict):
        raise SpecError(f"{path}: [policies] must be a table, got {type(table).__name__}")
    parsed = {}
    for metric, text in table.items():
        if not isinstance(text, str):
            raise SpecError(f"{path}: policies.{metric!r} must be a string, got {text!r}")
        try:
            parsed[metric] = Policy.parse(text)
        except ValueError as e:
            raise SpecError(f"{path}: policies.{metric!r}: {e}") from None
    return parsed


def load_read_options(path: str | Path | None) -> dict[str, Any]:
    """The spec's ``[read]`` table (format, run, duplicates, allow_skipped, at_source_precision)
    over the defaults of READ_OPTIONS; each checked here, so that a bad one fails before any
    run."""
    if path is None:
        return dict(READ_OPTIONS)
    table = _read_spec(Path(path)).get("read", {})
    if not isinstance(table, dict):
        raise SpecError(f"{path}: [read] must be a table, got {type(table).__name__}")
    return check_read_options(table, str(path))


def check_read_options(given: Mapping[str, Any] | None, source: str = "read") -> dict[str, Any]:
    """``given`` over READ_OPTIONS' defaults, every key and value checked (SpecError naming
    ``source``): the one set of reading options of compare, report, check, bisect and a spec's
    ``[read]`` table."""
    from parity.readers import DUPLICATE_RULES, FORMATS

    options = dict(READ_OPTIONS)
    for key, value in (given or {}).items():
        if key not in READ_OPTIONS:
            raise SpecError(f"{source}: unknown key {str(key)[:80]!r} in [read]; valid keys: "
                            f"{', '.join(READ_OPTIONS)}")  # fmt: skip
        options[key] = value
    checks = {
        "format": options["format"] is None or options["format"] in FORMATS,
        "run": options["run"] is None or isinstance(options["run"], str),
        "duplicates": options["duplicates"] in DUPLICATE_RULES,
        "allow_skipped": isinstance(options["allow_skipped"], bool),
        "at_source_precision": isinstance(options["at_source_precision"], bool),
    }
    for key, ok in checks.items():
        if not ok:
            raise SpecError(f"{source}: read.{key} = {options[key]!r} is not valid")
    return options


def read_keywords(options: Mapping[str, Any]) -> dict[str, Any]:
    """compare_runs' and build_report's keywords for reading options (``check_read_options``'
    dict): both sides read alike."""
    return {
        "fmt": options["format"], "run_a": options["run"], "run_b": options["run"],
        "duplicates": options["duplicates"], "allow_skipped": options["allow_skipped"],
        "at_source_precision": options["at_source_precision"],
    }  # fmt: skip


def load_check_options(path: str | Path | None) -> dict[str, Any]:
    """The spec's ``[check]`` table: ``carry``, the ignored paths check and bisect copy into
    each revision's worktree (a list of strings; parity.carry checks the paths themselves)."""
    options: dict[str, Any] = {"carry": []}
    if path is None:
        return options
    table = _read_spec(Path(path)).get("check", {})
    if not isinstance(table, dict):
        raise SpecError(f"{path}: [check] must be a table, got {type(table).__name__}")
    for key, value in table.items():
        if key not in options:
            raise SpecError(f"{path}: unknown key {str(key)[:80]!r} in [check]; valid keys: "
                            f"{', '.join(options)}")  # fmt: skip
        options[key] = value
    carry = options["carry"]
    if not isinstance(carry, list) or not all(isinstance(p, str) and p for p in carry):
        raise SpecError(f"{path}: check.carry must be a list of paths, got {carry!r}")
    _refuse_nul({"check.carry": carry})
    return options


# --- helpers -----------------------------------------------------------------------------------

_FIELDS = tuple(f.name for f in dataclasses.fields(JobSpec))
_GENERIC = tuple(f for f in _FIELDS if f != "options")  # the keys every job has


def _valid_keys(task: object, tables: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The keys a spec of ``task`` may have: every job's first, then the tables, then its
    preset's own (none where the task is not known: that is said on its own)."""
    try:
        preset = tasks.get(task) if isinstance(task, str) else None
    except SpecError:
        preset = None
    return (*_GENERIC, *tables, *(preset.keys if preset is not None else ()))


def _unknown(key: object, where: str, valid: tuple[str, ...]) -> None:
    close = difflib.get_close_matches(str(key), valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise SpecError(f"unknown key {str(key)[:80]!r} in {where}{hint}; valid keys: "
                    f"{', '.join(valid)}")  # fmt: skip


def _reject_unknown(data: Mapping[str, Any], source: str, tables: tuple[str, ...] = ()) -> None:
    """A key no spec of its task has is refused with the valid ones, every job's first."""
    valid = _valid_keys(data.get("task", CUSTOM), tables)
    for key in data:
        if key not in valid:
            _unknown(key, source, valid)


def _apply(base: JobSpec, overrides: Mapping[str, Any], source: str) -> JobSpec:
    if not isinstance(overrides, Mapping):
        raise SpecError(f"{source}: overrides must be a table, got {type(overrides).__name__}")
    _reject_unknown({"task": overrides.get("task", base.task), **overrides}, source)
    overrides = dict(overrides)
    if overrides.get("task", base.task) != base.task and "preload" not in overrides:
        preset = base.preset  # the base's preload, unless its own, is its task's: not the side's
        if base.preload == (list(preset.preload) if preset is not None else []):
            overrides["preload"] = None
    try:
        return dataclasses.replace(base, **overrides)
    except SpecError as e:
        raise SpecError(f"{source}: {e}") from None


def _check_stall(value: object) -> None:
    """``stall``: "auto", "off", or seconds (> 0, finite)."""
    if value in ("auto", "off"):
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(f'stall must be "auto", "off" or seconds, got {value!r}')
    if not value > 0 or value == float("inf"):
        raise SpecError(f"stall must be > 0 seconds and finite, got {value}")


def require_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """SpecError unless ``value`` is one of ``allowed`` (for presets' checks too)."""
    if value not in allowed:
        raise SpecError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def require_int(
    name: str, value: object, minimum: int | None = None, optional: bool = False
) -> None:
    """SpecError unless ``value`` is an int (not a bool) of at least ``minimum``; None passes
    when optional."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise SpecError(f"{name} must be >= {minimum}, got {value}")


def _plain(value: Any) -> Any:
    """A preset key's value as a spec file would give it: a path as its string, a tuple as a
    list (so that equal specs compare and print equal)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def _module_names(name: str, value: object, default: list[str]) -> list[str]:
    """A list of dotted module names (``default`` for None), each once: what `import` takes."""
    if value is None:
        return list(default)
    names = _str_list(name, value)
    for module in names:
        if not all(part.isidentifier() for part in module.split(".")):
            raise SpecError(f"{name}: {module!r} is not a module name (pkg.module)")
        if names.count(module) > 1:
            raise SpecError(f"{name}: {module!r} is listed twice")
    return names


def _str_list(name: str, value: object) -> list[str]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise SpecError(f"{name} must be a list of strings, got {value!r}")
    return list(value)


def require_flags(value: object) -> dict[str, Scalar]:
    """A table of extra job flags (``overrides = { val_samples = 16 }``): names without '=',
    scalar values; SpecError otherwise."""
    if not isinstance(value, Mapping):
        raise SpecError(f"overrides must be a table of key = value, got {value!r}")
    for key, v in value.items():
        if not isinstance(key, str) or not key or "=" in key:
            raise SpecError(f"overrides key must be a non-empty string without '=', got {key!r}")
        if not isinstance(v, str | int | float | bool):
            raise SpecError(f"overrides[{key!r}] must be a string, number or bool, got {v!r}")
    return dict(value)


def _env(value: object) -> dict[str, str]:
    """Variable names as a shell takes them; values strings (numbers and bools spelled out)."""
    if not isinstance(value, Mapping):
        raise SpecError(f"env must be a table of NAME = value, got {value!r}")
    out = {}
    for key, v in value.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise SpecError(f"env name must be a non-empty string without '=', got {key!r}")
        if not isinstance(v, str | int | float | bool):
            raise SpecError(f"env[{key!r}] must be a string, number or bool, got {v!r}")
        out[key] = format_scalar(v)
    return out


def _nul_at(value: object, where: str) -> str | None:
    """The key path (``command[2]``, ``env['X']``) of the first string in ``value`` that holds
    a NUL character, a mapping's keys included; None where none does."""
    if isinstance(value, str):
        return where if "\0" in value else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            at = f"{where}[{key!r}]"
            if isinstance(key, str) and "\0" in key:
                return at
            if found := _nul_at(item, at):
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if found := _nul_at(item, f"{where}[{i}]"):
                return found
    return None


def _refuse_nul(keys: Mapping[str, Any], prefix: str = "") -> None:
    """SpecError naming the key whose string holds a NUL: no argument, environment variable or
    path the launch hands to exec can carry one (exec would fail at launch, after the checks)."""
    for key, value in keys.items():
        if found := _nul_at(value, f"{prefix}{key}"):
            raise SpecError(f"{found} holds a NUL character (\\0), which no command line, "
                            "environment variable or path can carry")  # fmt: skip


def format_scalar(value: Scalar) -> str:
    """Flag values: bools as true/false (TOML/YAML spelling), the rest as ``str``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
