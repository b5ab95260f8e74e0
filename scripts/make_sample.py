"""Regenerate the sample dataset and tokenizer bundled in ``portable_loader/sample/``.

    python scripts/make_sample.py

Both are made here from nothing (no download): 2,000 synthetic chat conversations (arithmetic,
word reversal, letter counting; some multi-turn, some with a system prompt) and a byte-level BPE
tokenizer with 1,024 tokens trained on them, with a chat template in ``tokenizer_config.json`` that has
no ``{% generation %}`` block (the common case the loss masks must handle). Deterministic: the same
files come out every time.
"""

from __future__ import annotations

import json
import os
import random

OUT = os.path.join(os.path.dirname(__file__), "..", "portable_loader", "sample")
SPECIALS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
WORDS = "apple river stone cloud lantern meadow copper violin harbor pepper falcon marble orchard canyon".split()
SYSTEMS = ["You are a careful assistant.", "Answer briefly.", "You are a patient math tutor."]


def _turn(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        op = rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}."
    if kind == 1:
        words = rng.sample(WORDS, rng.randrange(2, 6))
        return "Reverse the words: " + " ".join(words), " ".join(reversed(words))
    word = rng.choice(WORDS)
    letter = rng.choice(sorted(set(word)))
    return f"How many times does '{letter}' appear in '{word}'?", f"'{letter}' appears {word.count(letter)} time(s) in '{word}'."


def make_dataset(n: int = 2000, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
        for _ in range(1 + (rng.random() < 0.3) + (rng.random() < 0.1)):
            question, answer = _turn(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages})
    return rows


def make_tokenizer(rows: list[dict], out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    texts = [m["content"] for row in rows for m in row["messages"]]
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    rows = make_dataset()
    with open(os.path.join(OUT, "sample_chat.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    make_tokenizer(rows, os.path.join(OUT, "tokenizer"))
    print(f"wrote {len(rows)} conversations and a tokenizer to {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
