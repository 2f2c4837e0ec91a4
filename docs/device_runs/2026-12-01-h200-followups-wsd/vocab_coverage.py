"""Draft-vocab coverage of held-out ShareGPT answer tokens: the answered file's answers (their first
128 tokens, as data.answer_tokens cuts them), 5 % of the records held out by a hash of their id, the
draft vocab taken as the N most frequent answer tokens of the rest (what the trainer's vocab map does):
python vocab_coverage.py answered.jsonl.gz"""

import collections
import gzip
import hashlib
import json
import sys

from models.embedded import embedded_target_dir
from models.target import load_tokenizer

tokenizer = load_tokenizer(embedded_target_dir())
train, held = collections.Counter(), collections.Counter()
for line in gzip.open(sys.argv[1], "rt"):
    r = json.loads(line)
    out = int(hashlib.sha256(r["id"].encode()).hexdigest()[:8], 16) % 20 == 0
    if out and not r["source"].startswith("sharegpt"):
        continue
    answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
    ids = [t for a in answers for t in tokenizer(a, add_special_tokens=False)["input_ids"][:128]]
    (held if out else train).update(ids)
ranked = [t for t, _ in train.most_common()]
total = sum(held.values())
print(f"training answer tokens {sum(train.values())}, distinct {len(ranked)}; held-out ShareGPT answer tokens {total}")
for n in (4096, 8192, 16000, 24000, 32000, len(ranked)):
    top = set(ranked[:n])
    print(f"draft vocab {n:>6}: {sum(c for t, c in held.items() if t in top) / total:.5f}")
