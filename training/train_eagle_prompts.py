"""User turns for `train_eagle`'s data beyond self-prompting: tasks over text the model did
not write, built on this machine with nothing fetched.

- Code tasks over real code: functions and classes of the Python standard library's own
  source (on every machine that runs this), with a task such as adding type hints or tests.
- Extraction tasks over synthetic documents (invoices, orders, notices, listings ...) filled
  from small word lists, asking for fields as JSON or a list.
- Everyday questions as people type them (how-to, explanations, lists of tips, comparisons,
  short writing) from question frames over topic lists: the self-prompted user turns of a
  135M model are rarely like these, and the head learnt the answers to its own questions
  far better than to people's.

The self-prompted turns of a model this small are mostly chat; these put code and documents
the answers must copy from into the data, as real coding and extraction prompts do. Each
family is a pure function of a `random.Random`, so a shard's turns depend on its seed alone.
"""

from __future__ import annotations

import ast
import functools
import os
import random
import sysconfig

CODE_TASKS = (
    "Add type hints to this code. Show the whole code.",
    "Explain what this code does, step by step.",
    "Write a docstring for this code.",
    "Rewrite this code to be shorter and clearer.",
    "Write pytest tests for this code.",
    "Find possible bugs in this code and show a fixed version.",
    "Add a comment to each important line of this code.",
    "Rename the variables of this code to clearer names. Show the whole code.",
    "What does this code return? Give an example call.",
    "Translate this code to JavaScript.",
)
_CODE_FRAMES = (
    "{task}\n\n```python\n{code}\n```",
    "```python\n{code}\n```\n\n{task}",
    "I have this function:\n\n{code}\n\n{task}",
    "{code}\n\n{task}",
)


@functools.cache
def _stdlib_snippets(min_lines: int = 4, max_lines: int = 40) -> tuple[str, ...]:
    """Source of every top-level function and class of the standard library's pure-Python
    modules with min_lines..max_lines lines, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("test", "tests", "site-packages", "idlelib",
                                          "lib2to3", "turtledemo", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    source = f.read()
                tree = ast.parse(source)
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if min_lines <= lines <= max_lines:
                        text = ast.get_source_segment(source, node)
                        if text and text.isascii():
                            out.append(text)
    return tuple(out)


def code_task(rng: random.Random) -> str:
    snippets = _stdlib_snippets()
    return rng.choice(_CODE_FRAMES).format(task=rng.choice(CODE_TASKS),
                                           code=rng.choice(snippets))


# ---- synthetic documents ------------------------------------------------------------------
_FIRST = ("Anna", "Ben", "Carla", "David", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas",
          "Kemal", "Lena", "Marco", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Sven",
          "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe")
_LAST = ("Andersen", "Brown", "Costa", "Dubois", "Evans", "Fischer", "Garcia", "Hughes",
         "Ivanova", "Jensen", "Kowalski", "Lambert", "Moreau", "Nakamura", "Okafor",
         "Petrov", "Rossi", "Silva", "Tanaka", "Weber")
_COMPANY = ("Bluebird Logistics", "Cedar & Pine Ltd", "Delta Optics", "Evergreen Foods",
            "Falcon Robotics", "Granite Works", "Harbor Line Shipping", "Ironleaf Software",
            "Juniper Health", "Kestrel Energy", "Lumen Labs", "Meridian Textiles",
            "Northstar Books", "Orchid Pharma", "Pioneer Tools")
_CITY = ("Lisbon", "Oslo", "Denver", "Osaka", "Lyon", "Leeds", "Porto", "Austin", "Gdansk",
         "Toronto", "Nairobi", "Melbourne", "Bergen", "Seville", "Utrecht")
_STREET = ("Mill Lane", "Station Road", "Oak Avenue", "Harbour Street", "Kingsway",
           "Church Street", "Market Square", "River Road", "Park Drive", "Hill Street")
_PRODUCT = ("USB-C cable", "desk lamp", "wireless mouse", "notebook (A5)", "office chair",
            "monitor stand", "ink cartridge", "laptop sleeve", "coffee beans (1 kg)",
            "label printer", "HDMI adapter", "whiteboard markers", "ergonomic keyboard")
_MONTH = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1, 28)} {rng.choice(_MONTH)} {rng.randint(2019, 2026)}"


def _address(rng: random.Random) -> str:
    return f"{rng.randint(1, 240)} {rng.choice(_STREET)}, {rng.choice(_CITY)}"


def _email(name: str, company: str) -> str:
    first, last = name.lower().split()
    domain = "".join(ch for ch in company.lower().split()[0] if ch.isalnum())
    return f"{first}.{last}@{domain}.example"


def _phone(rng: random.Random) -> str:
    return f"+{rng.randint(1, 49)} {rng.randint(100, 999)} {rng.randint(100, 999)} " \
           f"{rng.randint(1000, 9999)}"


def _invoice(rng: random.Random) -> tuple[str, list[str]]:
    seller, buyer = rng.sample(_COMPANY, 2)
    items = rng.sample(_PRODUCT, rng.randint(1, 4))
    lines, total = [], 0.0
    for item in items:
        qty, price = rng.randint(1, 12), rng.randint(3, 400) + rng.choice((0, 0.5, 0.99))
        total += qty * price
        lines.append(f"- {item}: {qty} x {price:.2f} EUR")
    number = f"{rng.choice('ABCDEFGH')}{rng.choice('KLMNPRST')}-{rng.randint(1000, 99999)}"
    doc = (f"INVOICE {number}\nDate: {_date(rng)}\nFrom: {seller}, {_address(rng)}\n"
           f"To: {buyer}, {_address(rng)}\n\nItems:\n" + "\n".join(lines)
           + f"\n\nTotal due: {total:.2f} EUR\nPayment within {rng.choice((14, 30, 60))} days.")
    return doc, ["invoice_number", "date", "seller", "buyer", "items", "total"]


def _contact(rng: random.Random) -> tuple[str, list[str]]:
    name, company = _person(rng), rng.choice(_COMPANY)
    role = rng.choice(("sales manager", "head of procurement", "support lead", "CFO",
                       "project coordinator", "office manager"))
    doc = (f"Hello,\n\nthank you for your message. I am the {role} at {company} and will be "
           f"your contact from now on. You can reach me at {_email(name, company)} or by "
           f"phone on {_phone(rng)}. Our office is at {_address(rng)}; I am there "
           f"{rng.choice(('Monday to Thursday', 'on weekdays', 'Tuesday to Friday'))}.\n\n"
           f"Best regards,\n{name}")
    return doc, ["name", "role", "company", "email", "phone", "address"]


def _event(rng: random.Random) -> tuple[str, list[str]]:
    kind = rng.choice(("workshop", "team offsite", "product launch", "board meeting",
                       "charity run", "book club evening"))
    host = _person(rng)
    doc = (f"You are invited to our {kind} on {_date(rng)} at {rng.randint(8, 19)}:"
           f"{rng.choice(('00', '15', '30', '45'))}. It takes place at {_address(rng)} and "
           f"lasts about {rng.randint(1, 6)} hours. Please confirm by "
           f"{_date(rng)} to {host} ({_phone(rng)}). Tickets cost "
           f"{rng.randint(0, 80)} EUR per person; up to {rng.randint(10, 200)} guests.")
    return doc, ["event", "date", "time", "location", "host", "price", "capacity"]


def _order(rng: random.Random) -> tuple[str, list[str]]:
    customer, product = _person(rng), rng.choice(_PRODUCT)
    doc = (f"Order #{rng.randint(100000, 999999)} confirmed.\nCustomer: {customer}\n"
           f"Ship to: {_address(rng)}\nProduct: {product} (quantity {rng.randint(1, 9)})\n"
           f"Shipping: {rng.choice(('standard', 'express', 'next day'))}, "
           f"{rng.randint(0, 25)} EUR\nExpected delivery: {_date(rng)}\n"
           f"Carrier: {rng.choice(_COMPANY)}, tracking {rng.randint(10**9, 10**10 - 1)}")
    return doc, ["order_number", "customer", "address", "product", "quantity", "shipping",
                 "delivery_date", "tracking"]


def _listing(rng: random.Random) -> tuple[str, list[str]]:
    rooms, city = rng.randint(1, 5), rng.choice(_CITY)
    doc = (f"For rent in {city}: bright {rooms}-room apartment, {rng.randint(35, 160)} m2, "
           f"floor {rng.randint(0, 9)}, {rng.choice(('with', 'without'))} balcony. Rent "
           f"{rng.randint(600, 3200)} EUR per month plus {rng.randint(80, 300)} EUR costs, "
           f"deposit {rng.randint(1, 3)} months. Available from {_date(rng)}. Viewing: "
           f"contact {_person(rng)}, {_phone(rng)}. Address: {_address(rng)}.")
    return doc, ["city", "rooms", "size_m2", "rent", "costs", "deposit", "available_from",
                 "contact"]


_DOCUMENTS = (_invoice, _contact, _event, _order, _listing)
_EXTRACT_FRAMES = (
    "{doc}\n\nExtract {fields} as JSON.",
    "Read this document:\n\n{doc}\n\nReturn a JSON object with the keys {fields}.",
    "{doc}\n\nList the {fields} of this document, one per line.",
    "Extract the following fields from the text below as JSON: {fields}.\n\n{doc}",
    "{doc}\n\nSummarize this document in two sentences, then give its {fields} as JSON.",
)


def extraction_task(rng: random.Random) -> str:
    doc, fields = rng.choice(_DOCUMENTS)(rng)
    chosen = sorted(rng.sample(fields, rng.randint(2, len(fields))), key=fields.index)
    return rng.choice(_EXTRACT_FRAMES).format(doc=doc, fields=", ".join(chosen))


# ---- everyday questions --------------------------------------------------------------------
# (frame, the topic list it takes); topics are lower-case noun phrases
_THINGS = ("a refrigerator", "a microwave oven", "a smartphone camera", "a compass",
           "a thermometer", "an electric kettle", "a washing machine", "a solar panel",
           "a vacuum cleaner", "a lock and key", "a parachute", "a hot air balloon",
           "an elevator", "a traffic light", "a submarine", "a wind turbine", "a calculator",
           "a printer", "a helicopter", "a light bulb", "a battery", "a sewing machine",
           "a piano", "a telescope", "an umbrella", "a zipper", "a toaster", "a dishwasher")
_NATURE = ("thunder", "earthquakes", "volcanoes", "ocean tides", "snowflakes", "fog",
           "hurricanes", "the seasons", "the northern lights", "coral reefs", "deserts",
           "glaciers", "rivers", "clouds", "the moon's phases", "eclipses", "wind", "soil",
           "fossils", "caves", "waterfalls", "rain forests", "lightning", "ice ages")
_ANIMALS = ("dolphins", "owls", "bees", "penguins", "elephants", "octopuses", "ants",
            "bats", "wolves", "parrots", "frogs", "salmon", "camels", "hedgehogs", "whales",
            "butterflies", "horses", "spiders", "tortoises", "squirrels", "crows", "sharks")
_SKILLS = ("learning a new language", "public speaking", "saving money", "running a 5k",
           "cooking for a family", "keeping a journal", "drawing portraits",
           "studying for exams", "working from home", "growing tomatoes",
           "writing a cover letter", "meditating", "swimming", "taking better photos",
           "making friends in a new city", "learning to code", "baking bread",
           "managing stress", "training a puppy", "reading more books", "playing chess",
           "staying focused", "waking up early", "negotiating a salary")
_TOPICS = ("recycling", "the internet", "vaccines", "the stock market", "democracy",
           "inflation", "renewable energy", "the water cycle", "gravity", "electricity",
           "the human heart", "dreams", "memory", "time zones", "credit scores", "music",
           "the printing press", "the Roman Empire", "the Olympic Games", "coffee",
           "chocolate", "cheese", "bread", "tea ceremonies", "carnivals", "libraries",
           "museums", "airports", "hospitals", "banks", "bridges", "skyscrapers", "robots",
           "artificial intelligence", "social media", "email", "passwords", "cloud storage")
_PLACES = ("a rainy afternoon", "a busy market", "a quiet library", "a mountain village",
           "a snowy forest", "a city at night", "a summer festival", "an old train station",
           "a farm in spring", "a harbor at dawn", "a school playground", "a desert road",
           "a kitchen on a holiday morning", "a garden after rain", "a crowded subway")
_PAIRS = (("a virus", "a bacterium"), ("a crocodile", "an alligator"), ("a frog", "a toad"),
          ("a rabbit", "a hare"), ("a city", "a town"), ("a comet", "an asteroid"),
          ("a violin", "a cello"), ("tea", "coffee"), ("baking", "roasting"),
          ("a loan", "a grant"), ("a hurricane", "a tornado"), ("a river", "a stream"),
          ("a poem", "a song"), ("an ocean", "a lake"), ("a planet", "a star"),
          ("speed", "velocity"), ("a moth", "a butterfly"), ("a mushroom", "a plant"),
          ("a debit card", "a credit card"), ("renting", "buying a home"))
_EVENTS = ("a birthday party", "a camping trip", "a first day at a new job",
           "a family dinner", "a long flight", "a beach holiday", "a job interview",
           "moving house", "a wedding", "a picnic", "a road trip", "a winter holiday",
           "a school science fair", "a marathon", "a dinner party for six friends")
_ITEMS = ("a coffee shop", "a pet goldfish", "a bookstore", "a hiking club", "a bakery",
          "a robot toy", "a garden", "a podcast about history", "a sailing boat",
          "a board game", "a food truck", "a yoga studio", "a cat", "a band", "a blog")
_FRAMES = (
    ("How does {} work?", _THINGS), ("Explain how {} works in simple words.", _THINGS),
    ("What is inside {}?", _THINGS), ("Who invented {}?", _THINGS),
    ("What causes {}?", _NATURE), ("Explain {} to a ten-year-old.", _NATURE),
    ("Why do we have {}?", _NATURE), ("Tell me three facts about {}.", _NATURE),
    ("How do {} communicate?", _ANIMALS), ("What do {} eat?", _ANIMALS),
    ("Where do {} live?", _ANIMALS), ("Tell me something surprising about {}.", _ANIMALS),
    ("Give me five tips for {}.", _SKILLS), ("How do I get started with {}?", _SKILLS),
    ("What are common mistakes when {}?", _SKILLS),
    ("Make a one-week plan for {}.", _SKILLS),
    ("What are the benefits of {}?", _SKILLS), ("Explain {} in a few sentences.", _TOPICS),
    ("What is the history of {}?", _TOPICS), ("What are the pros and cons of {}?", _TOPICS),
    ("Why is {} important?", _TOPICS), ("Summarize what {} is for a beginner.", _TOPICS),
    ("Write a short story about {}.", _PLACES), ("Describe {} in one paragraph.", _PLACES),
    ("Write a poem about {}.", _PLACES), ("Write a haiku about {}.", _PLACES),
    ("What should I bring to {}?", _EVENTS), ("How do I prepare for {}?", _EVENTS),
    ("Write a checklist for {}.", _EVENTS), ("Give me ideas to make {} fun.", _EVENTS),
    ("Suggest five names for {}.", _ITEMS), ("Write a slogan for {}.", _ITEMS),
    ("Write a short description of {}.", _ITEMS),
)
_PAIR_FRAMES = ("What is the difference between {} and {}?", "Compare {} and {}.",
                "Is {} the same as {}?", "How is {} different from {}?")
_OPENINGS = ("", "", "", "", "Hi! ", "Quick question: ", "Can you help me? ", "Please, ",
             "I'm curious. ")


def chat_task(rng: random.Random) -> str:
    """An everyday question as people type it (see the module's docstring)."""
    if rng.random() < 0.15:
        a, b = rng.choice(_PAIRS)
        text = rng.choice(_PAIR_FRAMES).format(a, b)
    else:
        frame, topics = rng.choice(_FRAMES)
        text = frame.format(rng.choice(topics))
    opening = rng.choice(_OPENINGS)
    if opening.endswith((": ", ", ")):  # the question goes on the opening's sentence
        text = text[0].lower() + text[1:]
    return opening + text
