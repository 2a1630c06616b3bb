"""The quick recipe's answers as if distilled with max_new_tokens=N: greedy decoding makes an answer cut at N
tokens the first N tokens of the answer cut at 192, so each response longer than N tokens (re-tokenised text)
is cut there and marked finish_reason 'length'."""
import json, sys
from medusa_infer.models import load_tokenizer
src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = load_tokenizer("smollm2-135m-instruct")
cut = kept = tokens = 0
with open(src) as f, open(dst, "w") as out:
    for line in f:
        row = json.loads(line)
        ids = tok(row["response"], add_special_tokens=False)["input_ids"]
        if row["response_tokens"] > n and len(ids) > n:
            row["response"] = tok.decode(ids[:n])
            row["finish_reason"], row["response_tokens"] = "length", n
            cut += 1
        else:
            kept += 1
        row["generation"]["max_new_tokens"] = n
        tokens += row["response_tokens"]
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
print(f"{cut} cut at {n} tokens, {kept} kept whole, {tokens} response tokens")
