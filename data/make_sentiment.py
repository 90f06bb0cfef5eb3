"""Writes data/sentiment-{train,dev}.tsv: short reviews whose label (1 positive, 0 negative)
no single word decides.

Each sentence puts a subject with an adjective in a frame. Frames that negate ("was not",
"far from", "hardly", "it is not true that") flip the adjective's polarity, and contrast frames
("I expected ... to be X, but it was Y") name an adjective of the other polarity as a
distractor. Every adjective and every frame word occurs in both classes, so counting keywords
stays near chance; a model has to read the sentence. The dev set's sentences do not occur in
the training set. Run: python data/make_sentiment.py
"""

from __future__ import annotations

import random
from pathlib import Path

SUBJECTS = ["the movie", "this film", "the soup", "our hotel room", "the concert",
            "the new phone", "her latest novel", "the service", "the lecture", "the game",
            "the museum tour", "his performance", "the coffee", "the train ride", "the sequel",
            "the app update", "the pasta", "the documentary", "the workshop", "the album"]
POSITIVE = ["good", "great", "wonderful", "delightful", "excellent", "charming", "impressive",
            "enjoyable", "pleasant", "superb"]
NEGATIVE = ["bad", "awful", "boring", "terrible", "dull", "disappointing", "unpleasant",
            "mediocre", "poor", "dreadful"]
# (frame, flips the adjective's polarity)
FRAMES = [("{s} was {a}.", False), ("{s} turned out to be {a}.", False),
          ("honestly, {s} was really {a}.", False), ("{s} was not {a}.", True),
          ("{s} was far from {a}.", True), ("i would hardly call {s} {a}.", True),
          ("it is not true that {s} was {a}.", True), ("nobody could say {s} was {a}.", True),
          ("i expected {s} to be {b}, but it was {a}.", False),
          ("they said {s} would be {b}; it was {a}.", False),
          ("i expected {s} to be {b}, and it was not.", "b")]


def sentence(rng: random.Random) -> tuple[str, int]:
    frame, rule = rng.choice(FRAMES)
    positive = rng.random() < 0.5
    adj = rng.choice(POSITIVE if positive else NEGATIVE)
    other = rng.choice(NEGATIVE if positive else POSITIVE)
    if rule == "b":  # "expected {b}, and it was not": the opposite of b
        text, label = frame.format(s=rng.choice(SUBJECTS), b=adj), not positive
    else:
        text = frame.format(s=rng.choice(SUBJECTS), a=adj, b=other)
        label = positive != rule
    return text[0].upper() + text[1:], int(label)


def main(train: int = 1200, dev: int = 300, seed: int = 7) -> None:
    rng = random.Random(seed)
    seen, rows = set(), {"train": [], "dev": []}
    for split, n in (("train", train), ("dev", dev)):
        while len(rows[split]) < n:
            text, label = sentence(rng)
            if text not in seen:
                seen.add(text)
                rows[split].append(f"{text}\t{label}")
    for split, lines in rows.items():
        path = Path(__file__).with_name(f"sentiment-{split}.tsv")
        path.write_text("sentence\tlabel\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
