"""Prompts the real-model checks share: code, prose, chat markup, digits, several languages."""

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\nx = np.arange(10)\n",
    "Q: What is 17 plus 25?\nA:",
    "The quick brown fox",
    "In 1969, the first humans",
    "Photosynthesis is the process by which",
    "List of planets: Mercury, Venus,",
    "<|im_start|>user\nWrite a haiku about rain.<|im_end|>\n<|im_start|>assistant\n",
    "The best way to learn a new language is",
    "SELECT name, age FROM users WHERE",
    "Bonjour, je m'appelle",
    "1, 2, 3, 5, 8, 13,",
]
