#!/usr/bin/env python3
"""Writes the small Kimi-format tokenizer of the tests, and golden encodings from OpenAI's tiktoken.

Kimi model folders ship a tiktoken BPE: `tiktoken.model` (one token per line: its bytes in base64
and its rank) and `tokenizer_config.json` (`added_tokens_decoder`: the special tokens, which take
the 256 ids after the BPE's; the ids without an entry are reserved). This script trains a few
hundred byte-level BPE merges on a short multilingual sample, pre-split with Kimi's split pattern,
and writes those two files plus `golden.json`: texts and their ids as the Python `tiktoken` package
encodes them, the outside reference the crate's tokenizer is tested against.

    pip install tiktoken regex
    python3 scripts/make_test_tokenizer.py tests/fixtures/tokenizer

CI does not run it; the files it wrote are committed.
"""

import base64
import collections
import json
import pathlib
import sys

import regex
import tiktoken

# Kimi's split pattern (letters outside Han, Han runs, up to 3 digits, punctuation, spaces).
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

SAMPLE = """
The quick brown fox jumps over the lazy dog. The dog doesn't mind; it's asleep.
Kimi Delta Attention keeps a state per head and updates it with a gated delta rule.
Mixture-of-experts layers route every token to the experts with the highest scores.
We'll train the model, then we're going to generate text with it. They've said they'd try.
线性注意力把每个头的状态保存在矩阵中。专家混合层把每个词元路由到得分最高的专家。
In 2025 there were 128 experts, 8 of them active; 1234567 tokens per second.
def forward(self, x):\n    return self.w2(silu(self.w1(x)) * self.w3(x))\n
Ünïcödé wörds, naïve café, résumé; ДОБРЫЙ день, Привет мир!
"""

MERGES = 200
SPECIAL = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>"}
NUM_RESERVED = 256

TESTS = [
    "The quick brown fox jumps over the lazy dog.",
    "it's they'd WE'LL Don't",
    "线性注意力把每个头的状态保存在矩阵中。",
    "Digits: 1234567 and 3.14159",
    "  leading spaces,\ttabs\n\nand newlines  \n",
    "def forward(self, x):\n    return x\n",
    "[BOS]Hello<|im_end|>world[EOS]",
    "emoji 🦀 and ümlauts and Привет",
    "",
]


def train(text):
    # VERSION1: the pattern intersects character classes (`&&`), which version 0 reads literally.
    words = collections.Counter(regex.findall(KIMI_PATTERN, text, flags=regex.V1))
    pieces = {w: [bytes([b]) for b in w.encode()] for w in words}
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(MERGES):
        pairs = collections.Counter()
        for w, n in words.items():
            p = pieces[w]
            for a, b in zip(p, p[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        # Most frequent pair; ties broken by the bytes, so the result is reproducible.
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        for w in words:
            p, out, i = pieces[w], [], 0
            while i < len(p):
                if i + 1 < len(p) and p[i] == a and p[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(p[i])
                    i += 1
            pieces[w] = out
    return ranks


def main(out):
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ranks = train(SAMPLE)
    n = len(ranks)
    with open(out / "tiktoken.model", "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    added = {
        str(n + i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
        for i, c in SPECIAL.items()
    }
    config = {
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    specials = {SPECIAL.get(i, f"<|reserved_token_{n + i}|>"): n + i for i in range(NUM_RESERVED)}
    enc = tiktoken.Encoding("kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                            special_tokens=specials)
    golden = [{"text": t, "ids": enc.encode(t, allowed_special="all")} for t in TESTS]
    for g in golden:
        assert enc.decode(g["ids"]) == g["text"]
    (out / "golden.json").write_text(json.dumps(
        {"num_base_tokens": n, "num_special_tokens": NUM_RESERVED, "encodings": golden},
        ensure_ascii=False, indent=1) + "\n")
    print(f"{n} BPE tokens + {NUM_RESERVED} special ids written to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tokenizer")
