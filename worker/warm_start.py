"""The SFT-warmed actor for charcount PPO: the tiny Qwen2 after a short SFT run on charcount.

PPO from the untrained model never writes a `\\boxed{k}` answer, so `reward/mean` would be 0 at
every step and a parity check would compare zeros only. This fine-tunes the committed tiny model
with the worker SFT trainer (one process, seeded), then saves it as a Hugging Face model folder
next to it. Run `python -m worker.warm_start` to regenerate it; the recipe is recorded in
`recipe.json` there.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from worker.data.charcount import FIXTURES

WARM_MODEL_DIR = FIXTURES / "tiny-qwen2-charcount"
RECIPE = ["--trainer", "worker", "--steps", "400", "--lr", "3e-3", "--seed", "0", "--save-final"]


def build_warm_model(out: Path = WARM_MODEL_DIR) -> None:
    """SFT the committed tiny model on charcount and save the result to `out` (one process)."""
    import json

    from safetensors.torch import load_file

    from worker.entry import fit_and_finish
    from worker.model import TINY_MODEL_DIR, load_model, weights_sha256
    from worker.trainers.sft import SFTTrainer
    from worker.trainers.sft_common import SFTJob, parse_config

    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_config(["--out", tmp, *RECIPE])
        job = SFTJob.build(cfg)
        fit_and_finish(job, SFTTrainer(job).fit, job.save_final)
        model = load_model(TINY_MODEL_DIR)
        model.load_state_dict(load_file(str(Path(tmp) / "final.safetensors")))
        last = json.loads((Path(tmp) / "metrics.jsonl").read_text().splitlines()[-2])
    out.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.save_pretrained(str(out), safe_serialization=True)
    recipe = {
        "command": "python -m worker.warm_start",
        "sft_args": RECIPE,
        "base_model_sha256": weights_sha256(TINY_MODEL_DIR),
        "final_train_loss": last["train/loss"],
        "weights_sha256": weights_sha256(out),
    }
    (out / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m worker.warm_start", description=__doc__)
    p.add_argument("--out", type=Path, default=WARM_MODEL_DIR)
    build_warm_model(p.parse_args(argv).out)


if __name__ == "__main__":
    main()
