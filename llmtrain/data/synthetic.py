"""Deterministic data for the tiny recipes, shipped in llmtrain/assets/data.

`sft_tiny`: reverse a short string of letters. A random model scores ~1/26 per response token;
a two-layer model learns the task within a few hundred steps, so learning is visible in a minute.
`pretrain_tiny`: sentences from a small grammar, so the loss falls well below log(vocab).
Regenerate with `python -m llmtrain.data.synthetic`.
"""

import json
import random
import string
from pathlib import Path

ASSET_DATA_DIR = Path(__file__).resolve().parent.parent / "assets" / "data"

SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a bird", "the teacher"]
VERBS = ["sees", "likes", "follows", "draws", "finds", "helps", "hears"]
OBJECTS = ["the ball", "a red box", "the river", "an apple", "the moon", "a small house", "the book"]
PLACES = ["in the park", "at home", "near the sea", "on monday", "every day", "after lunch"]


def reversal_samples(n: int, seed: int, min_len: int = 3, max_len: int = 8) -> list[dict]:
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))
        samples.append({"prompt": f"reverse: {word}\n", "response": word[::-1]})
    return samples


def grammar_text_samples(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        sentences = [
            f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}."
            for _ in range(rng.randint(1, 4))
        ]
        samples.append({"text": " ".join(sentences)})
    return samples


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    write_jsonl(ASSET_DATA_DIR / "reverse_train.jsonl", reversal_samples(4000, seed=1))
    write_jsonl(ASSET_DATA_DIR / "reverse_eval.jsonl", reversal_samples(256, seed=2))
    write_jsonl(ASSET_DATA_DIR / "grammar_train.jsonl", grammar_text_samples(4000, seed=3))
    write_jsonl(ASSET_DATA_DIR / "grammar_eval.jsonl", grammar_text_samples(256, seed=4))
    print(f"wrote {ASSET_DATA_DIR}")


if __name__ == "__main__":
    main()
