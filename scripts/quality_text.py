#!/usr/bin/env python3
"""The fixed text the README's quality table scores with `twice perplexity`.

Every CPython ships the text of its Language Reference's topics as `pydoc_data.topics`
(pydoc's `help('if')` reads them): about 465,000 characters of English prose with some
grammar and code, ~110,000 tokens for SmolLM2's tokenizer. Nothing is downloaded and
every machine with the same Python has the same text: the topics are joined in sorted
order of their names, each with trailing white space removed from its lines, separated by
a blank line. The text is the Python documentation (PSF License v2), used here as a
benchmark input and never redistributed; no public-domain English corpus ships with
Python or with the packages twice installs. The text differs between Python versions, so
the script prints the version and the text's sha256 with it: compare numbers only over
the same hash.

    python scripts/quality_text.py quality.txt      # writes the file (atomically), prints its facts
    python scripts/quality_text.py -                # the text on standard output
    twice perplexity quality.txt --model M --context 512 --max-tokens 16384 --json
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path


def quality_text() -> str:
    from pydoc_data.topics import topics

    parts = ["\n".join(line.rstrip() for line in topics[name].strip("\n").splitlines()) for name in sorted(topics)]
    return "\n\n".join(parts) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/quality_text.py OUT.txt | -", file=sys.stderr)
        return 2
    text = quality_text()
    data = text.encode("utf-8")
    facts = {"source": "pydoc_data.topics", "python": platform.python_version(), "characters": len(text),
             "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if argv[0] == "-":
        sys.stdout.write(text)
    else:
        from twice.weights.safe_write import write_atomic

        write_atomic(Path(argv[0]), data)
        facts["path"] = argv[0]
    print(json.dumps(facts), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
