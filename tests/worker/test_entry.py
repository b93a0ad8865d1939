"""worker.entry: a launched job starts up without the cyclic garbage collector, trains with it,
and its models are still freed while the process group exists."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A job as worker.sft is one, without torch.distributed: a "model" in a reference cycle (as
# wrapped modules are) built during the start-up, dropped when train() returns. The shutdown
# that destroys the process group reports whether the model was already gone.
JOB = textwrap.dedent(
    """
    import gc, json, sys, weakref
    from pathlib import Path
    from types import SimpleNamespace

    import worker.distributed
    from worker.entry import fit_and_finish, run_job

    seen, models = {}, []


    class Model:
        def __init__(self):
            self.me = self


    def shutdown():
        seen["model_freed_before_shutdown"] = models[0]() is None
        seen["frozen_at_shutdown"] = gc.get_freeze_count()
        print(json.dumps(seen), flush=True)


    worker.distributed.shutdown_distributed = shutdown


    def train(argv):
        seen["gc_during_start_up"] = gc.isenabled()
        model = Model()
        models.append(weakref.ref(model))
        out = Path(argv[0])
        log = SimpleNamespace(finish=lambda steps: None, close=lambda: None)
        job = SimpleNamespace(
            dist=SimpleNamespace(rank=0), cfg=SimpleNamespace(out=out, steps=1), log=log
        )

        def fit():
            seen["gc_during_training"] = gc.isenabled()
            seen["start_up_frozen"] = gc.get_freeze_count() > 0

        fit_and_finish(job, fit)


    run_job(train, sys.argv[1:])
    """
)


def test_start_up_without_gc_training_with_it_models_freed_before_shutdown(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", JOB, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {
        "gc_during_start_up": False,
        "gc_during_training": True,
        "start_up_frozen": True,
        "model_freed_before_shutdown": True,
        "frozen_at_shutdown": 0,
    }
    assert (tmp_path / "timing.json").is_file()
