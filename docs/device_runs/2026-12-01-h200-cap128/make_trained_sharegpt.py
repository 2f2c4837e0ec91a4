"""64 ShareGPT first prompts of the answered file on the training side of the trainer's split (hash of the
first prompt, fraction 0.01, seed 0), shuffled with seed 0, written as held-out-file records:
python make_trained_sharegpt.py answered.jsonl.gz trained_sharegpt.jsonl"""

import gzip
import json
import random
import sys

from trainer.data.split import split_holdout

answered, out = sys.argv[1], sys.argv[2]
rows = [json.loads(line) for line in gzip.open(answered, "rt")]
sharegpt = [r for r in rows if r["source"] == "sharegpt"]
train, held = split_holdout([r["messages"] for r in sharegpt], 0.01, 0)
trained = {id(conv) for conv in train}
picked = [r for r in sharegpt if id(r["messages"]) in trained]
random.Random(0).shuffle(picked)
with open(out, "w") as f:
    for r in picked[:64]:
        f.write(json.dumps({"id": f"trained:{r['id']}", "source": "sharegpt", "prompt": r["messages"][0]["content"]}) + "\n")
print(f"{len(sharegpt)} ShareGPT conversations, {len(held)} held out, 64 written to {out}")
