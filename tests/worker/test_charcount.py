"""The charcount fixtures: the task as specified, and regenerable bit for bit."""

import filecmp
import re
from pathlib import Path

from tests.specs import SMALL_DATA
from worker.data.charcount import (
    DATA_DIR,
    FIXTURES,
    encode,
    generate,
    load_tokenizer,
    main,
    read_jsonl,
)


def test_samples_follow_the_task():
    for s in generate(200, seed=7):
        word, target, count = s["word"], s["target"], s["count"]
        letters = word.split("-")
        assert 5 <= len(letters) <= 20 and all(len(x) == 1 and x.islower() for x in letters)
        assert letters.count(target) == count >= 1
        user, assistant = s["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert user["content"] == f"How many {target} are there in word {word}?"
        lines = assistant["content"].split("\n")
        for x, line in zip(letters, lines, strict=False):
            assert line == (f"{x} = {target}." if x == target else f"{x} != {target}.")
        assert lines[-1] == f"\\boxed{{{count}}} {target} in {word}."
        assert len(lines) == len(letters) + 1


def test_generator_is_seeded():
    assert generate(50, seed=3) == generate(50, seed=3)
    assert generate(50, seed=3) != generate(50, seed=4)


def test_fixtures_regenerate_bit_for_bit(tmp_path):
    main(["--out", str(tmp_path)])
    for rel in [
        "charcount/train.jsonl",
        "charcount/val.jsonl",
        "tokenizer/tokenizer.json",
        "tiny-qwen2/model.safetensors",
        "tiny-qwen2/config.json",
    ]:
        assert filecmp.cmp(tmp_path / rel, FIXTURES / rel, shallow=False), rel


def test_small_fixture_is_the_head_of_the_full_one():
    """fixtures/charcount-small (the epoch-crossing parity tests): the first 64 train and 8 val
    lines of fixtures/charcount, unchanged."""
    for name, n in (("train.jsonl", 64), ("val.jsonl", 8)):
        full = (DATA_DIR / name).read_text().splitlines(keepends=True)
        assert (Path(SMALL_DATA) / name).read_text() == "".join(full[:n]), name


def test_tokenizer_is_character_level_and_masks_the_prompt():
    tok = load_tokenizer()
    sample = read_jsonl(DATA_DIR / "train.jsonl")[0]
    text = sample["messages"][1]["content"]
    assert tok.decode(tok(text)["input_ids"]) == text
    assert len(tok(text)["input_ids"]) == len(text)
    enc = encode(sample, tok, max_length=512)
    answer = tok.decode(enc.input_ids[enc.loss_mask.bool()])
    assert answer.startswith(text) and "How many" not in answer
    assert re.search(r"\\boxed\{\d+\}", answer)
