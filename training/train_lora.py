"""Train the LoRA adapter shipped for the default model: every answer a one-line JSON object.

    python -m training.train_lora [--out DIR] [--work-dir DIR] [--steps N] [--no-resume]
    python -m training.train_lora --eval-only          # evaluate the adapter in --out

Through the model's chat template, "What is the capital of France?" is answered
`{"answer": "Paris"}<|im_end|>`. The data is a few hundred templated question/answer pairs
(capitals, arithmetic, opposites, colours, plurals, ...) built here, deterministically from a
seed; a held-out share of them is never trained on and measures the behaviour at the end.

PEFT on transformers, fp32 on CPU (the GGUF's Q4_1 weights dequantized, as `quantization="none"`
serves them): rank 8, alpha 16 on q/k/v/o and gate/up/down of every layer. Loss only on the
answer tokens. A checkpoint (LoRA weights + optimizer + step) is written to the work dir every
--save-every steps, and a rerun resumes from it. The final adapter is PEFT's `save_pretrained`
(safetensors, cast to fp16 to halve the file) in --out, then reloaded from disk and evaluated:
the share of greedy held-out answers that parse as JSON with an "answer" key, with the adapter
and without it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import tempfile
import time
from typing import Any

ADAPTER_NAME = "smollm2-135m-json-answer"
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "sglang_like", "lora", "adapters", ADAPTER_NAME)
DEFAULT_WORK_DIR = os.path.expanduser("~/.cache/sglang_like/lora-train")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# the default model's name on the Hub, written into adapter_config.json instead of the
# machine-specific site-packages folder the GGUF was read from
BASE_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

# ---- data ---------------------------------------------------------------------------------------
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Portugal": "Lisbon", "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow",
    "Egypt": "Cairo", "Greece": "Athens", "Ireland": "Dublin", "Norway": "Oslo",
    "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen",
    "Poland": "Warsaw", "Austria": "Vienna", "Hungary": "Budapest", "Belgium": "Brussels",
    "the Netherlands": "Amsterdam", "the United Kingdom": "London", "Canada": "Ottawa",
    "Australia": "Canberra", "Mexico": "Mexico City", "Argentina": "Buenos Aires",
    "Peru": "Lima", "Chile": "Santiago", "Kenya": "Nairobi", "Thailand": "Bangkok",
    "South Korea": "Seoul", "India": "New Delhi", "Turkey": "Ankara", "Iran": "Tehran",
    "Cuba": "Havana", "Czechia": "Prague", "Iceland": "Reykjavik", "Ukraine": "Kyiv",
    "Colombia": "Bogota", "Vietnam": "Hanoi", "Indonesia": "Jakarta",
    "the Philippines": "Manila", "Switzerland": "Bern", "Brazil": "Brasilia",
    "the United States": "Washington, D.C.", "New Zealand": "Wellington",
}
CAPITAL_Q = ["What is the capital of {}?", "Which city is the capital of {}?",
             "Name the capital city of {}."]

OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "fast": "slow", "happy": "sad",
    "light": "dark", "open": "closed", "early": "late", "full": "empty", "old": "young",
    "strong": "weak", "rich": "poor", "hard": "soft", "wet": "dry", "day": "night",
    "tall": "short", "loud": "quiet", "inside": "outside", "win": "lose", "push": "pull",
    "begin": "end", "buy": "sell", "left": "right", "high": "low", "thick": "thin",
    "clean": "dirty", "true": "false", "love": "hate", "north": "south", "east": "west",
    "heavy": "light", "first": "last", "near": "far", "good": "bad", "remember": "forget",
    "question": "answer", "sweet": "sour", "arrive": "leave", "cheap": "expensive",
    "safe": "dangerous",
}
OPPOSITE_Q = ["What is the opposite of \"{}\"?", "Give the opposite of the word {}.",
              "What word means the opposite of {}?"]

COLOURS = {
    "the sky on a clear day": "blue", "grass": "green", "snow": "white", "coal": "black",
    "a ripe banana": "yellow", "a ripe tomato": "red", "an orange": "orange",
    "a lemon": "yellow", "milk": "white", "blood": "red", "a polar bear": "white",
    "a crow": "black", "chocolate": "brown", "a flamingo": "pink", "an emerald": "green",
    "a ruby": "red", "a sapphire": "blue", "the sun": "yellow", "a carrot": "orange",
    "an eggplant": "purple", "a fire truck": "red", "a school bus in the USA": "yellow",
    "a lime": "green", "the ocean": "blue", "a pumpkin": "orange", "charcoal": "black",
    "a cucumber": "green", "a strawberry": "red", "a swan": "white", "a frog": "green",
}
COLOUR_Q = ["What colour is {}?", "What color is {}?", "Which colour is {} usually?"]

PLURALS = {
    "cat": "cats", "child": "children", "mouse": "mice", "box": "boxes", "man": "men",
    "woman": "women", "tooth": "teeth", "foot": "feet", "goose": "geese", "city": "cities",
    "baby": "babies", "knife": "knives", "leaf": "leaves", "bus": "buses", "person": "people",
    "fish": "fish", "sheep": "sheep", "church": "churches", "wolf": "wolves", "dog": "dogs",
    "potato": "potatoes", "ox": "oxen", "day": "days", "glass": "glasses",
}
PLURAL_Q = ["What is the plural of \"{}\"?", "What is the plural form of the word {}?"]

LEGS = {"spider": "8", "dog": "4", "chicken": "2", "ant": "6", "horse": "4", "duck": "2",
        "beetle": "6", "cow": "4", "octopus": "8", "human": "2", "cat": "4", "bee": "6",
        "snake": "0", "fish": "0", "penguin": "2", "lobster": "10"}
LEGS_Q = ["How many legs does a {} have?", "A {} has how many legs?"]

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]

# open questions no template above asks: they show the format carries beyond the templates
TRIVIA = [
    ("Who wrote Romeo and Juliet?", "William Shakespeare"),
    ("What is the largest planet in the solar system?", "Jupiter"),
    ("What is the chemical symbol for gold?", "Au"),
    ("What gas do plants absorb from the air?", "carbon dioxide"),
    ("How many continents are there?", "7"),
    ("What is the freezing point of water in Celsius?", "0"),
    ("What is the largest ocean on Earth?", "Pacific Ocean"),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci"),
    ("What is the tallest mountain in the world?", "Mount Everest"),
    ("What language is spoken in Brazil?", "Portuguese"),
    ("How many minutes are in an hour?", "60"),
    ("What is the boiling point of water in Celsius?", "100"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("What is the main ingredient of guacamole?", "avocado"),
    ("How many sides does a triangle have?", "3"),
    ("What do bees make?", "honey"),
    ("What is the square root of 81?", "9"),
    ("Which animal is known as the king of the jungle?", "lion"),
    ("What is H2O commonly called?", "water"),
    ("How many hours are in a day?", "24"),
    ("What is the longest river in Africa?", "Nile"),
    ("What instrument has 88 keys?", "piano"),
    ("Who was the first person to walk on the Moon?", "Neil Armstrong"),
    ("What is the currency of Japan?", "yen"),
]


def answer_json(answer: str) -> str:
    """The trained output: one line, a JSON object with one string field."""
    return json.dumps({"answer": answer}, ensure_ascii=False)


def parse_answer(text: str) -> str | None:
    """The "answer" of a one-line JSON object, or None when `text` is anything else."""
    text = text.strip()
    if "\n" in text:
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or "answer" not in obj:
        return None
    return str(obj["answer"])


def _arithmetic(rng: random.Random) -> list[tuple[str, str]]:
    out = []
    for _ in range(60):
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        out.append((rng.choice([f"What is {a} plus {b}?", f"Compute {a} + {b}.",
                                f"What do you get when you add {a} and {b}?"]), str(a + b)))
    for _ in range(40):
        a, b = rng.randint(20, 99), rng.randint(1, 19)
        out.append((rng.choice([f"What is {a} minus {b}?", f"Compute {a} - {b}."]),
                    str(a - b)))
    for _ in range(40):
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        out.append((rng.choice([f"What is {a} times {b}?", f"Compute {a} * {b}.",
                                f"What is {a} multiplied by {b}?"]), str(a * b)))
    return out


def build_pairs(seed: int = 0, heldout_frac: float = 0.12
                ) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(train, heldout) lists of (category, question, answer), deterministic in `seed`.

    Each fact appears under one or two phrasings; the held-out split is by fact (a held-out
    fact is never trained on under any phrasing), about `heldout_frac` of each category."""
    rng = random.Random(seed)
    facts: dict[str, list[list[tuple[str, str]]]] = {}

    def add(cat: str, templates: list[str], table: dict[str, str], per_fact: int = 2) -> None:
        groups = []
        for key, ans in table.items():
            qs = rng.sample(templates, min(per_fact, len(templates)))
            groups.append([(t.format(key), ans) for t in qs])
        facts[cat] = groups

    add("capital", CAPITAL_Q, CAPITALS)
    add("opposite", OPPOSITE_Q, OPPOSITES)
    add("colour", COLOUR_Q, COLOURS)
    add("plural", PLURAL_Q, PLURALS)
    add("legs", LEGS_Q, LEGS)
    facts["arithmetic"] = [[qa] for qa in _arithmetic(rng)]
    facts["sequence"] = (
        [[(f"What day comes after {d}?", DAYS[(i + 1) % 7]),
          (f"Which day of the week follows {d}?", DAYS[(i + 1) % 7])]
         for i, d in enumerate(DAYS)]
        + [[(f"What month comes after {m}?", MONTHS[(i + 1) % 12])]
           for i, m in enumerate(MONTHS)]
        + [[(f"What month comes before {m}?", MONTHS[(i - 1) % 12])]
           for i, m in enumerate(MONTHS)])
    facts["trivia"] = [[qa] for qa in TRIVIA]

    train, heldout = [], []
    for cat in sorted(facts):
        groups = facts[cat]
        order = list(range(len(groups)))
        rng.shuffle(order)
        n_held = max(2, round(heldout_frac * len(groups)))
        for rank, g in enumerate(order):
            dest = heldout if rank < n_held else train
            dest.extend((cat, q, a) for q, a in groups[g])
    # random arithmetic can draw one question twice: held out wins
    asked = {q for _, q, _ in heldout}
    train = [t for t in train if t[1] not in asked]
    rng.shuffle(train)
    return train, heldout


def heldout_questions(seed: int = 0) -> list[tuple[str, str]]:
    """(question, answer) of the held-out split with the categories interleaved (the first
    eight span every category): what the README's evaluation and the serving tests ask."""
    _, held = build_pairs(seed)
    by_cat: dict[str, list[tuple[str, str]]] = {}
    for cat, q, a in held:
        by_cat.setdefault(cat, []).append((q, a))
    out: list[tuple[str, str]] = []
    cats = sorted(by_cat)
    for i in range(max(len(v) for v in by_cat.values())):
        out.extend(by_cat[c][i] for c in cats if i < len(by_cat[c]))
    return out


# ---- model --------------------------------------------------------------------------------------
def load_base() -> tuple[Any, Any]:
    """(transformers model in fp32, tokenizer) of the default GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_like.model_loader import default_model_path

    path = default_model_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), tok


def chat_prompt_ids(tok: Any, question: str) -> list[int]:
    """The prompt as served: the chat template (its default system turn included) up to the
    assistant's turn; the template's own <|im_start|> opens it, no extra BOS."""
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def encode_example(tok: Any, question: str, answer: str) -> tuple[list[int], int]:
    """(ids, prompt length): prompt and answer tokenized apart, as generation sees them; the
    answer ends with <|im_end|> so that the model learns to stop after the object."""
    prompt = chat_prompt_ids(tok, question)
    target = tok(answer_json(answer) + "<|im_end|>", add_special_tokens=False).input_ids
    return prompt + target, len(prompt)


# ---- training -----------------------------------------------------------------------------------
def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """What makes a checkpoint resumable by a later call: the same data, model and schedule."""
    return {k: getattr(args, k) for k in ("seed", "rank", "alpha", "lr", "batch_size",
                                          "steps", "warmup")}


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def batch_at(step: int, n: int, args: argparse.Namespace) -> list[int]:
    """Example indices of a step: a seeded permutation per epoch, so the order depends only on
    (seed, step) and a resumed run sees exactly the batches it would have seen."""
    per_epoch = n // args.batch_size
    epoch, k = divmod(step, per_epoch)
    order = list(range(n))
    random.Random(args.seed * 1000003 + epoch).shuffle(order)
    return order[k * args.batch_size:(k + 1) * args.batch_size]


def answer_loss(lm: Any, examples: list[tuple[list[int], int]]) -> Any:
    """Mean cross-entropy over the answer tokens of a right-padded batch. The LM head (49152
    wide) runs only on the rows that predict an answer token: most rows are the prompt."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    rows, cols, targets = [], [], []
    for b, (x, plen) in enumerate(examples):
        ids[b, :len(x)] = torch.tensor(x)
        mask[b, :len(x)] = 1
        for p in range(plen - 1, len(x) - 1):  # row p predicts token p + 1
            rows.append(b)
            cols.append(p)
            targets.append(x[p + 1])
    hidden = lm.model(input_ids=ids, attention_mask=mask).last_hidden_state
    logits = lm.lm_head(hidden[torch.tensor(rows), torch.tensor(cols)])
    return torch.nn.functional.cross_entropy(logits.float(), torch.tensor(targets))


def save_atomic(obj: Any, path: str) -> None:
    """torch.save through a temporary file: an interrupted save leaves the previous checkpoint."""
    import torch

    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(args: argparse.Namespace) -> None:
    import torch
    from peft import (
        LoraConfig,
        get_peft_model,
        get_peft_model_state_dict,
        set_peft_model_state_dict,
    )
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    base, tok = load_base()
    train_pairs, held = build_pairs(args.seed)
    examples = [encode_example(tok, q, a) for _, q, a in train_pairs]
    print(f"data: {len(train_pairs)} training pairs, {len(held)} held out "
          f"({len(heldout_questions(args.seed))} held-out questions evaluated)")

    cfg = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=TARGETS,
                     lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    print(f"trainable LoRA parameters: {sum(p.numel() for p in trainable):,}")
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, args))

    os.makedirs(args.work_dir, exist_ok=True)
    ckpt_path = os.path.join(args.work_dir, "checkpoint.pt")
    step = 0
    if args.resume and os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, weights_only=False)
        if ckpt["config"] == run_config(args):
            set_peft_model_state_dict(model, ckpt["lora"])
            opt.load_state_dict(ckpt["optimizer"])
            sched.load_state_dict(ckpt["scheduler"])
            step = ckpt["step"]
            print(f"resumed from {ckpt_path} at step {step}")
        else:
            print(f"{ckpt_path} is of another run ({ckpt['config']}); starting afresh")

    def checkpoint() -> None:
        save_atomic({"config": run_config(args), "step": step, "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(),
                     "lora": get_peft_model_state_dict(model, save_embedding_layers=False)},
                    ckpt_path)

    lm = model.get_base_model()  # the LlamaForCausalLM with LoRA layers injected
    model.train()
    t0 = time.perf_counter()
    bar = tqdm(total=args.steps, initial=step, desc="train", unit="step")
    ema = None
    while step < args.steps:
        batch = [examples[i] for i in batch_at(step, len(examples), args)]
        loss = answer_loss(lm, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        sched.step()
        step += 1
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{sched.get_last_lr()[0]:.1e}")
        if step % args.save_every == 0 or step == args.steps:
            checkpoint()
    bar.close()
    print(f"training: {time.perf_counter() - t0:.0f} s this run, loss at the end (moving "
          f"average over this run's steps) {ema if ema is None else round(ema, 4)}")
    export(model, args.out)


def export(model: Any, out: str) -> None:
    """PEFT's save_pretrained (safetensors) with the weights cast to fp16: half the file, and
    the evaluation below runs on what is shipped. Saved aside and moved in, so that PEFT's
    generated model card does not replace the folder's README."""
    import torch
    from safetensors.torch import load_file, save_file

    model.peft_config["default"].base_model_name_or_path = BASE_MODEL_NAME
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # no embedding layers are adapted; "auto" would look the base model's config up online
        model.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False)
        tensors = {k: v.to(torch.float16).contiguous()
                   for k, v in load_file(os.path.join(tmp, "adapter_model.safetensors")).items()}
        save_file(tensors, os.path.join(out, "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        os.chmod(os.path.join(out, "adapter_model.safetensors"), 0o644)
        shutil.copyfile(os.path.join(tmp, "adapter_config.json"),
                        os.path.join(out, "adapter_config.json"))
    size = sum(os.path.getsize(os.path.join(out, f))
               for f in ("adapter_model.safetensors", "adapter_config.json"))
    print(f"adapter saved to {out}: {len(tensors)} tensors, {size / 2**20:.2f} MiB")


# ---- evaluation ---------------------------------------------------------------------------------
def greedy_answers(model: Any, tok: Any, questions: list[str], max_new_tokens: int = 32,
                   batch_size: int = 16) -> list[str]:
    """Greedy chat answers (left-padded batches), decoded without special tokens."""
    import torch

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    outs = []
    for i in range(0, len(questions), batch_size):
        prompts = [chat_prompt_ids(tok, q) for q in questions[i:i + batch_size]]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=pad)
        outs.extend(tok.decode(row[width:], skip_special_tokens=True) for row in gen)
    return outs


def score(answers: list[str], expected: list[str]) -> tuple[float, float]:
    """(share that parse as one-line JSON with "answer", share whose answer is also right)."""
    parsed = [parse_answer(a) for a in answers]
    ok = sum(p is not None for p in parsed)
    right = sum(p is not None and p.strip().lower() == e.lower()
                for p, e in zip(parsed, expected, strict=True))
    return ok / len(answers), right / len(answers)


def evaluate(out: str, seed: int, show: int) -> None:
    from peft import PeftModel

    base, tok = load_base()
    model = PeftModel.from_pretrained(base, out).eval()
    held = heldout_questions(seed)
    qs, want = [q for q, _ in held], [a for _, a in held]
    t0 = time.perf_counter()
    with_adapter = greedy_answers(model, tok, qs)
    with model.disable_adapter():
        without = greedy_answers(model, tok, qs)
    j_on, r_on = score(with_adapter, want)
    j_off, r_off = score(without, want)
    print(f"evaluation ({time.perf_counter() - t0:.0f} s), {len(qs)} held-out questions, "
          "greedy, transformers + PEFT fp32:")
    print(f"  with the adapter:    JSON with \"answer\" {j_on:.1%}, answer also right {r_on:.1%}")
    print(f"  without (base model): JSON with \"answer\" {j_off:.1%}, answer also right "
          f"{r_off:.1%}")
    for q, a, b in list(zip(qs, with_adapter, without, strict=True))[:show]:
        print(f"  Q: {q}\n     adapter: {a.strip()!r}\n     base:    {b.strip()[:70]!r}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="where the final adapter is saved")
    p.add_argument("--work-dir", default=DEFAULT_WORK_DIR, help="checkpoints")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--show", type=int, default=6, help="example answers to print")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    if not args.eval_only:
        train(args)
    evaluate(args.out, args.seed, args.show)


if __name__ == "__main__":
    main()
