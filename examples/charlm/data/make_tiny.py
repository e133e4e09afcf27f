"""Writes tiny.txt: about 40 KB of self-written sentences from a small grammar (seeded, so the
file is the same every time). Only needed to regenerate the committed file."""

import random
from pathlib import Path

SUBJECTS = ["the old miller", "a tired sailor", "the lighthouse keeper", "my grandmother", "the young clerk",
            "a quiet fox", "the river", "the night train", "a stranger from the hills", "the baker's cat"]
VERBS = ["watched", "remembered", "followed", "carried", "forgot", "painted", "waited for", "counted",
         "listened to", "mended"]
OBJECTS = ["the grey harbour", "a letter with no name", "the last lantern", "seven copper coins",
           "the road to the sea", "an empty boat", "the winter stars", "a basket of apples",
           "the broken clock", "the smell of rain"]
ENDINGS = ["before the morning came", "while the wind was rising", "and said nothing at all",
           "as the bells rang twice", "until the fire went out", "without looking back",
           "because nobody else would", "in the blue hour after supper"]


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}"
    return s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?"])


def main() -> None:
    rng = random.Random(0)
    paragraphs = [" ".join(sentence(rng) for _ in range(rng.randint(3, 7))) for _ in range(110)]
    Path(__file__).with_name("tiny.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
