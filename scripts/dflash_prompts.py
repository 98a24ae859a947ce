"""Instruction prompts for training the DFlash drafter of the embedded default target.

Written for this project: task templates crossed with topics. The held-out set uses topics and
templates that never occur in the training set, so its hit rate measures generalisation.

Two training sets: ``train`` (620 prompts, answered by the lab's own ``generate``,
scripts/make_dflash_data.py) and ``engine_train`` (several thousand: the 620 plus many more
topics x templates x length asks, answered by vLLM's engine, scripts/make_dflash_engine_data.py).
Neither uses a held-out topic or template; ``tests/test_dflash.py`` checks that.

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


MORE_TOPICS = [
    # science and nature
    "atoms", "electricity", "the speed of light", "evolution", "DNA", "the solar system", "Mars", "comets",
    "the ozone layer", "clouds", "ocean currents", "fossils", "the rock cycle", "plate tectonics", "sound waves",
    "friction", "rainforests", "bees and flowers", "migration of birds", "octopuses", "elephants", "ants",
    "wolves", "sharks", "butterflies", "frogs", "trees", "seeds", "soil", "the nitrogen cycle", "antibiotics",
    "the human skeleton", "muscles", "the digestive system", "blood", "eyesight", "hearing", "allergies",
    "viruses", "nutrition", "vitamins", "exercise", "stress", "the common cold", "dreams", "memory",
    "habits", "volcanic islands", "caves", "waterfalls", "mountains", "the Arctic", "Antarctica", "the Sahara",
    "lakes", "wetlands", "pollination", "camouflage in animals", "hibernation", "the food chain", "algae",
    "jellyfish", "dolphins", "horses", "cats", "dogs", "parrots", "crows", "snakes", "turtles", "lions",
    # technology
    "smartphones", "batteries", "the light bulb", "radio", "television", "satellites", "GPS", "3D printing",
    "robots", "artificial intelligence", "machine learning", "cloud computing", "passwords", "encryption",
    "email", "search engines", "social media", "video games", "the World Wide Web", "open source software",
    "databases", "spreadsheets", "programming languages", "the Python language", "version control",
    "computer memory", "microchips", "airplanes", "rockets", "the steam engine", "bridges", "skyscrapers",
    "dams", "elevators", "refrigerators", "washing machines", "microwave ovens", "traffic lights",
    "electric grids", "hydroelectric power", "nuclear power", "geothermal energy", "hydrogen fuel", "drones",
    # history and society
    "ancient Greece", "the Vikings", "the Aztecs", "the Maya", "the Ming dynasty", "the Ottoman Empire",
    "the Cold War", "the Berlin Wall", "the American Revolution", "the Magna Carta", "the Black Death",
    "the age of exploration", "the invention of writing", "ancient Rome's roads", "castles", "knights",
    "samurai", "pirates", "the Wright brothers", "Marie Curie", "Isaac Newton", "Albert Einstein",
    "Leonardo da Vinci", "Shakespeare", "Mozart", "the United Nations", "elections", "taxes", "money",
    "banks", "inflation", "trade", "supply and demand", "small businesses", "advertising", "cities",
    "villages", "public transport", "volunteering", "human rights", "museums", "newspapers", "languages",
    "sign language", "maps", "calendars", "clocks", "holidays", "weddings", "festivals", "folk tales",
    # everyday life and culture
    "cooking pasta", "baking cookies", "pizza", "rice", "cheese", "apple pie", "spices", "vegetables",
    "fruit", "breakfast", "picnics", "camping", "hiking", "swimming", "running", "yoga", "cycling to work",
    "football", "basketball", "tennis", "cricket", "the guitar", "drawing", "painting", "photography",
    "poetry", "novels", "libraries at school", "homework", "exams", "learning a language", "teachers",
    "moving to a new city", "saving money", "budgeting", "flower arranging", "houseplants", "pets",
    "cleaning a kitchen", "sleeping well", "morning routines", "teamwork", "leadership", "public speaking",
    "job interviews", "writing a resume", "friendship at school", "family dinners", "grandparents",
    "neighbours", "board games", "puzzles", "magic tricks", "the circus", "zoos", "theme parks", "beaches",
    "snow", "rain", "autumn", "spring", "summer holidays", "winter sports", "road trips", "airports",
    "hotels", "maps and navigation", "recycling at home", "saving water", "composting", "kindness to strangers",
]
MORE_TEMPLATES = [
    "Explain {t} in simple terms.", "Teach me the basics of {t}.", "What is {t} and how does it work?",
    "Write a short essay about {t}.", "Write a blog post introduction about {t}.",
    "Write a children's story about {t}.", "Give me five questions and answers about {t}.",
    "Compare {t} with something similar.", "What would the world be like without {t}?",
    "Write a dialogue between two friends about {t}.", "Give me a step-by-step guide related to {t}.",
    "What are the main ideas behind {t}?", "Write a short speech about {t}.", "How has {t} changed over time?",
    "Write a product description for a book about {t}.", "What can we learn from {t}?",
]
LENGTHS = ["", " Answer in one paragraph.", " Keep it under 100 words.", " Be detailed.",
           " Use a numbered list.", " Answer in two short paragraphs."]


def build(seed: int = 0, engine_train: int = 6200) -> dict:
    """``{"train": [...], "engine_train": [...], "held_out": [...]}``: 620 training prompts (the
    lab's own generation), ``engine_train`` training prompts (the 620 plus templates x topics x
    length asks, for the engine's generation), 32 held-out ones."""
    train = [tpl.format(t=t) for t in TRAIN_TOPICS for tpl in TRAIN_TEMPLATES] + HANDWRITTEN
    held = [tpl.format(t=t) for t in HELD_OUT_TOPICS for tpl in HELD_OUT_TEMPLATES]
    random.Random(seed).shuffle(train)
    random.Random(seed + 1).shuffle(held)
    topics = TRAIN_TOPICS + [t for t in MORE_TOPICS if t not in TRAIN_TOPICS]
    combos = [tpl.format(t=t) + ln for t in topics for tpl in TRAIN_TEMPLATES + MORE_TEMPLATES for ln in LENGTHS]
    rng = random.Random(seed + 2)
    rng.shuffle(combos)
    seen = set(train)
    more = [c for c in combos if c not in seen][: max(0, engine_train - len(train))]
    engine = train + more
    rng.shuffle(engine)
    return {"train": train, "engine_train": engine, "held_out": held}


def main() -> None:
    out = Path(__file__).resolve().parents[1] / "fixtures" / "drafters" / "dflash_prompts.json"
    out.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
