"""The training corpus: the King James Bible from Debian's bible-kjv package.

`bible -f "Gen1:1-Rev22:21"` prints one verse per line, each starting with
its reference ("Ge1:1 In the beginning God created ..."). The references
are stripped: they are 6% of the bytes, carry no language, and a
small byte-level model would spend capacity on counting chapter and verse
numbers. What remains is the verse text, one verse per line, ASCII only
(4,137,850 bytes, 31,102 lines).

Split (fixed, by book): the last two books, Jude and Revelation (verses
30674..31102 of the `bible` output, 429 verses, 65,598 bytes, 1.6% of the
text) are held out for validation; Genesis..3 John is the training set.

  /usr/bin/python3 scripts/train/corpus.py [OUT_DIR]   (default build-data/kjv)

writes OUT_DIR/train.txt and OUT_DIR/valid.txt (deterministic).
"""
import os
import re
import subprocess
import sys

REFERENCE = re.compile(rb"^[1-3]?[A-Z][A-Za-z]*[0-9]+:[0-9]+ ")
FIRST_HELD_OUT = b"Jude1:1 "


def verses():
    raw = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True).stdout
    lines = raw.rstrip(b"\n").split(b"\n")
    assert len(lines) == 31102, f"expected 31102 verses, got {len(lines)}"
    return lines


def build(out_dir):
    lines = verses()
    split = next(i for i, line in enumerate(lines) if line.startswith(FIRST_HELD_OUT))
    text = []
    for line in lines:
        m = REFERENCE.match(line)
        assert m, line[:40]
        text.append(line[m.end():] + b"\n")
    os.makedirs(out_dir, exist_ok=True)
    train, valid = b"".join(text[:split]), b"".join(text[split:])
    for name, data in (("train.txt", train), ("valid.txt", valid)):
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data)
    return train, valid


def ensure(out_dir):
    """Builds the split unless both files are already there."""
    paths = [os.path.join(out_dir, n) for n in ("train.txt", "valid.txt")]
    if not all(os.path.exists(p) for p in paths):
        build(out_dir)
    return paths


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "build-data/kjv"
    train, valid = build(out)
    nl = b"\n"
    print(f"{out}/train.txt: {len(train)} bytes, {train.count(nl)} verses (Genesis..3 John)")
    print(f"{out}/valid.txt: {len(valid)} bytes, {valid.count(nl)} verses (Jude, Revelation)")
