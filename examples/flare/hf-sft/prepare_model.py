"""Builds, offline, what FLARE's LLM example downloads: a model, its tokenizer and data.

FLARE's ``examples/advanced/llm_hf`` fine-tunes ``EleutherAI/gpt-neo-1.3B`` from the Hub
on Dolly, Alpaca and OASST1 (``utils/preprocess_*.py``). A site without network (or a
test, or a machine without a GPU) gets the same shapes, small:

- ``<model_dir>``: a GPT-Neo causal LM built from a config (the 1.3B model's
  architecture, 0.1M parameters), saved with ``save_pretrained``, and a word-level
  tokenizer trained on the records (``PreTrainedTokenizerFast`` with eos and pad
  tokens) saved beside it, so ``AutoModelForCausalLM.from_pretrained(model_dir)`` and
  ``AutoTokenizer.from_pretrained(model_dir)`` work with ``HF_HUB_OFFLINE=1``;
- ``<data_path>/<site>/training.jsonl`` and ``validation.jsonl`` for each site: Dolly-style
  records (``{"input": ..., "output": ...}``, what ``preprocess_dolly.py`` writes and
  ``client.py``'s ``format_instruction`` reads), short arithmetic questions and their
  answers, a different mix for each site.

    python prepare_model.py --model_dir /tmp/nvflare/models/tiny-gpt-neo \\
        --data_path /tmp/nvflare/dataset --client_ids site-1 site-2

Then ``python job.py --model_name_or_path /tmp/nvflare/models/tiny-gpt-neo
--data_path /tmp/nvflare/dataset --client_ids site-1 site-2 ...`` as FLARE's README
says. Any Hub model folder and FLARE's preprocessed data work the same way.
"""

import argparse
import json
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here reads the Hub

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import GPTNeoConfig, GPTNeoForCausalLM, PreTrainedTokenizerFast, set_seed

EOS = "<|endoftext|>"
PAD = "<|pad|>"
UNK = "<|unk|>"
NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
THINGS = ["apples", "pears", "plums", "books", "coins", "shells"]
PLACES = ["market", "school", "harbor", "station", "garden"]
# What client.py's format_instruction puts around every record (its words must be known).
PROMPT = (
    "### Instruction: Generate Output according to the information and question given by "
    "Input. ### Input:{input} ### Response: {output}"
)


def record(rng: random.Random, site: int) -> dict:
    """One Dolly-style record: a context and a question as ``input``, the answer as
    ``output``; site `site` leans to its own kind of question (non-IID sites)."""
    who, other = rng.sample(NAMES, 2)
    what, where = rng.choice(THINGS), rng.choice(PLACES)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if rng.random() < (0.75 if site % 2 == 0 else 0.25):
        context = f"{who} has {a} {what} at the {where} . {other} gives {who} {b} more ."
        question = f"how many {what} does {who} have now ?"
        answer = f"{who} has {a + b} {what} now ."
    else:
        context = f"{who} has {a + b} {what} at the {where} . {who} gives {other} {b} ."
        question = f"how many {what} does {who} have left ?"
        answer = f"{who} has {a} {what} left ."
    first = rng.random() < 0.5  # preprocess_dolly.py puts the context first or last
    text = f"{context}\n\n{question}" if first else f"{question}\n\n{context}"
    return {"input": text, "output": answer}


def write_data(data_path: str, sites: list[str], n_train: int, n_valid: int) -> list[dict]:
    rng = random.Random(0)
    every = []
    for i, site in enumerate(sites):
        folder = os.path.join(data_path, site)
        os.makedirs(folder, exist_ok=True)
        for name, n in (("training.jsonl", n_train), ("validation.jsonl", n_valid)):
            records = [record(rng, i) for _ in range(n)]
            every += records
            with open(os.path.join(folder, name), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        print(f"wrote {n_train} training and {n_valid} validation records to {folder}")
    return every


def write_model(model_dir: str, records: list[dict], max_positions: int) -> None:
    texts = [PROMPT.format(**r) for r in records]
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=[PAD, UNK, EOS]))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK, bos_token=EOS
    )
    tokenizer.model_max_length = max_positions
    # GPT-Neo's shape (global and local attention layers), small.
    config = GPTNeoConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_positions,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=64,
        intermediate_size=256,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    set_seed(0)  # the same initial weights every time
    model = GPTNeoForCausalLM(config)
    os.makedirs(model_dir, exist_ok=True)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote a GPT-Neo of {params} parameters, vocabulary {len(tokenizer)}, to {model_dir}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model_dir", default="/tmp/nvflare/models/tiny-gpt-neo")
    p.add_argument("--data_path", default="/tmp/nvflare/dataset")
    p.add_argument("--client_ids", nargs="+", default=["site-1", "site-2"])
    p.add_argument("--train", type=int, default=160, help="training records per site")
    p.add_argument("--valid", type=int, default=32, help="validation records per site")
    p.add_argument("--max_positions", type=int, default=128)
    args = p.parse_args()
    records = write_data(args.data_path, args.client_ids, args.train, args.valid)
    write_model(args.model_dir, records, args.max_positions)


if __name__ == "__main__":
    main()
