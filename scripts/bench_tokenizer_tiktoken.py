#!/usr/bin/env python3
"""Python `tiktoken` on the tokenizer benchmark text, for docs/PERFORMANCE.md.

Builds a tiktoken Encoding from the cl100k fixture (same ranks, K3's pat_str,
K3's 256 specials, as tokenization_kimi.py does), encodes the text that
`cargo bench -p deltafin-text --bench tokenizer` dumped (DELTAFIN_BENCH_DUMP),
checks the ids are identical to deltafin's, and prints the median MB/s, for
tiktoken alone and with the 400k/25k-character slicing that K3's
tokenization_kimi.py `encode` wraps around it (deltafin's `encode` slices too).

    DELTAFIN_BENCH_DUMP=/tmp/tokbench cargo bench -p deltafin-text --bench tokenizer
    python3 scripts/bench_tokenizer_tiktoken.py --dump /tmp/tokbench
"""

import argparse
import base64
import json
import os
import statistics
import time

import tiktoken

# K3's pre-tokenizer (tokenization_kimi.py `pat_str`), the same eight
# alternatives as crates/text/src/tokenizer/pretokenize.rs.
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
N_SPECIAL = 256


def load_encoding(model_dir):
    ranks = {}
    with open(os.path.join(model_dir, "tiktoken.model"), "rb") as f:
        for line in f:
            line = line.strip()
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        named = {int(k): v["content"] for k, v in json.load(f)["added_tokens_decoder"].items()}
    base = len(ranks)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + N_SPECIAL)}
    return tiktoken.Encoding(name="k3-cl100k", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000


def split_runs(s, max_run):
    """Cut `s` wherever a whitespace or non-whitespace run exceeds `max_run` characters."""
    start, run_len, run_space = 0, 0, s[:1].isspace()
    for i, c in enumerate(s):
        space = c.isspace()
        if space != run_space:
            run_space, run_len = space, 1
        else:
            run_len += 1
            if run_len > max_run:
                yield s[start:i]
                start, run_len = i, 1
    yield s[start:]


def reference_encode(enc, text, **kwargs):
    """The slicing K3's tokenization_kimi.py `encode` does around tiktoken."""
    ids = []
    for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        for sub in split_runs(text[i:i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS):
            ids.extend(enc.encode(sub, **kwargs))
    return ids


def median_seconds(fn, runs):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=os.path.join(here, "..", "tests", "fixtures", "tokenizer", "cl100k"))
    parser.add_argument("--dump", required=True, help="DELTAFIN_BENCH_DUMP directory written by the cargo bench")
    parser.add_argument("--runs", type=int, default=11)
    args = parser.parse_args()

    enc = load_encoding(args.model_dir)
    with open(os.path.join(args.dump, "bench_text.txt"), encoding="utf-8", newline="") as f:
        text = f.read()
    with open(os.path.join(args.dump, "bench_ids.json")) as f:
        rust_ids = json.load(f)
    n_bytes = len(text.encode("utf-8"))

    ids = reference_encode(enc, text, disallowed_special=())
    assert ids == rust_ids, "tiktoken and deltafin disagree on the benchmark text"
    with open(os.path.join(args.dump, "bench_ids_special.json")) as f:
        rust_ids_special = json.load(f)
    assert reference_encode(enc, text, allowed_special="all") == rust_ids_special, "disagreement with specials"
    unsliced_same = enc.encode_ordinary(text) == ids
    print(f"tiktoken {tiktoken.__version__}: {n_bytes} bytes, {len(text)} chars, {len(ids)} tokens, "
          f"ids identical to deltafin's (with and without specials); "
          f"unsliced tiktoken ids {'also identical' if unsliced_same else 'differ at a 400k-character seam'}")

    for name, fn in [
        ("tiktoken encode_ordinary (engine only, unsliced)", lambda: enc.encode_ordinary(text)),
        ("tiktoken encode(allowed_special='all') (engine only)", lambda: enc.encode(text, allowed_special="all")),
        ("reference encode (slicing + tiktoken, no specials)",
         lambda: reference_encode(enc, text, disallowed_special=())),
        ("decode_bytes", lambda: enc.decode_bytes(ids)),
    ]:
        fn()  # warm-up
        median, times = median_seconds(fn, args.runs)
        print(f"{name}: median {median * 1e3:.1f} ms over {args.runs} runs = {n_bytes / 1e6 / median:.2f} MB/s "
              f"(min {min(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
