"""Instruction prompts for training the DFlash drafter of the embedded default target.

Written for this project: task templates crossed with topics. The held-out set uses topics and
templates that never occur in the training set, so its hit rate measures generalisation.

    python scripts/dflash_prompts.py   # writes fixtures/drafters/dflash_prompts.json
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TRAIN_TOPICS = [
    "photosynthesis", "the water cycle", "volcanoes", "the French Revolution", "black holes", "honey bees",
    "the human heart", "recycling", "the stock market", "electric cars", "the Roman Empire", "rainbows",
    "coral reefs", "the immune system", "solar panels", "the moon landing", "chess", "coffee",
    "the printing press", "earthquakes", "penguins", "compound interest", "the internet", "gravity",
    "the Great Wall of China", "vaccines", "dinosaurs", "climate change", "the piano", "bread baking",
    "magnets", "the Amazon rainforest", "democracy", "sleep", "the periodic table", "tornadoes",
    "friendship", "public libraries", "the Olympic Games", "tea ceremonies", "bicycles", "glaciers",
    "the Renaissance", "bacteria", "wind turbines", "the ocean tides", "time management", "owls",
    "the Eiffel Tower", "sorting algorithms", "spiders", "the Silk Road", "meditation", "rivers",
    "computer viruses", "the camera", "mushrooms", "the Industrial Revolution", "deserts", "kindness",
]
HELD_OUT_TOPICS = [
    "lighthouses", "the Egyptian pyramids", "hummingbirds", "nuclear fusion", "origami", "the jazz age",
    "submarines", "the human brain", "wildfires", "chocolate", "the Moon's phases", "trains",
    "whales", "the telescope", "gardening", "thunderstorms",
]
TRAIN_TEMPLATES = [
    "Explain {t} to a ten-year-old.", "Write a short paragraph about {t}.", "What are three facts about {t}?",
    "Give me a brief history of {t}.", "Why is {t} important?", "Write a short poem about {t}.",
    "Describe {t} in simple words.", "List the pros and cons of {t}.", "Write a short story that involves {t}.",
    "What are common misconceptions about {t}?",
]
HELD_OUT_TEMPLATES = [
    "Tell me something interesting about {t}.", "Summarize what everyone should know about {t}.",
]
HANDWRITTEN = [
    "Write a Python function that checks whether a number is prime.", "How do I make a cup of green tea?",
    "Give me five tips for a job interview.", "Write an email asking my manager for a day off.",
    "What is the difference between weather and climate?", "Translate 'good morning' into French and Spanish.",
    "Write a haiku about snow.", "How many days are there in a leap year, and why?",
    "Write a recipe for a simple tomato soup.", "Explain what a for loop is in programming.",
    "What should I pack for a weekend camping trip?", "Write a thank-you note to a neighbour.",
    "How does a refrigerator keep food cold?", "Give me a plan to learn to run five kilometres.",
    "Explain the rules of football briefly.", "What is the Pythagorean theorem?",
    "Write a limerick about a cat.", "How do I change a flat bicycle tyre?",
    "What is a healthy breakfast?", "Write a SQL query that counts the rows of a table named users.",
]


def build(seed: int = 0) -> dict:
    """``{"train": [...], "held_out": [...]}``: 620 training prompts, 32 held-out ones."""
    train = [tpl.format(t=t) for t in TRAIN_TOPICS for tpl in TRAIN_TEMPLATES] + HANDWRITTEN
    held = [tpl.format(t=t) for t in HELD_OUT_TOPICS for tpl in HELD_OUT_TEMPLATES]
    random.Random(seed).shuffle(train)
    random.Random(seed + 1).shuffle(held)
    return {"train": train, "held_out": held}


def main() -> None:
    out = Path(__file__).resolve().parents[1] / "fixtures" / "drafters" / "dflash_prompts.json"
    out.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
