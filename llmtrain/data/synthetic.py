"""Deterministic data for the tiny recipes, shipped in llmtrain/assets/data.

`sft_tiny`: reverse a short string of letters. A random model scores ~1/26 per response token;
a two-layer model learns the task within a few hundred steps, so learning is visible in a minute.
Reward-model and DPO recipes: the same task as preference pairs (chosen = the reversal), with easy
negatives (another word, or the word unreversed) and hard ones (the reversal with one letter changed or
two neighbours swapped), tagged by `kind` so evaluation can report each.
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


PREFERENCE_KINDS = ("easy", "hard")


def random_word(rng: random.Random, min_len: int = 3, max_len: int = 8) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))


def reversal_samples(n: int, seed: int, min_len: int = 3, max_len: int = 8) -> list[dict]:
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        word = random_word(rng, min_len, max_len)
        samples.append({"prompt": f"reverse: {word}\n", "response": word[::-1]})
    return samples


def reversal_preferences(n: int, seed: int, kinds: tuple[str, ...] = PREFERENCE_KINDS,
                         min_len: int = 3, max_len: int = 8) -> list[dict]:
    """n pairs, as many of each kind (to within one), in a seeded random order; rejected != chosen always."""
    rng = random.Random(seed)
    order = [kinds[i % len(kinds)] for i in range(n)]
    rng.shuffle(order)
    rows = []
    for kind in order:
        word = random_word(rng, min_len, max_len)
        chosen = word[::-1]
        rejected = NEGATIVES[kind](rng, word, chosen, min_len, max_len)
        rows.append({"prompt": f"reverse: {word}\n", "chosen": chosen, "rejected": rejected, "kind": kind})
    return rows


def easy_negative(rng: random.Random, word: str, chosen: str, min_len: int, max_len: int) -> str:
    """Half the time the word left unreversed (unless a palindrome), else a random word of similar length."""
    if rng.random() < 0.5 and word != chosen:
        return word
    low, high = max(min_len, len(word) - 1), min(max_len, len(word) + 1)
    while True:
        other = random_word(rng, low, high)
        if other != chosen:
            return other


def hard_negative(rng: random.Random, word: str, chosen: str, min_len: int, max_len: int) -> str:
    """The reversal with one letter substituted, or two different neighbours swapped (half the time each)."""
    swappable = [i for i in range(len(chosen) - 1) if chosen[i] != chosen[i + 1]]
    letters = list(chosen)
    if rng.random() < 0.5 and swappable:  # "aaa" has no swap that changes it: substituted instead
        i = rng.choice(swappable)
        letters[i], letters[i + 1] = letters[i + 1], letters[i]
    else:
        i = rng.randrange(len(letters))
        letters[i] = rng.choice([c for c in string.ascii_lowercase if c != letters[i]])
    return "".join(letters)


NEGATIVES = {"easy": easy_negative, "hard": hard_negative}


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
    write_jsonl(ASSET_DATA_DIR / "reverse_prefs_train.jsonl", reversal_preferences(4000, seed=5))
    write_jsonl(ASSET_DATA_DIR / "reverse_prefs_eval.jsonl", reversal_preferences(512, seed=6))  # 256 of each kind
    write_jsonl(ASSET_DATA_DIR / "reverse_prefs_easy_train.jsonl", reversal_preferences(2000, seed=7, kinds=("easy",)))
    write_jsonl(ASSET_DATA_DIR / "reverse_prefs_easy_eval.jsonl", reversal_preferences(256, seed=8, kinds=("easy",)))
    print(f"wrote {ASSET_DATA_DIR}")


if __name__ == "__main__":
    main()
