"""The fenced Python blocks of one section of a Markdown file (the docs' executed examples)."""
from __future__ import annotations

import re


def python_blocks(path: str, heading: str) -> list[str]:
    """The ```python blocks between the heading line `heading` (exact text after the #s)
    and the next heading of the same or a higher level."""
    lines = open(path, encoding="utf-8").read().splitlines()
    start = level = None
    for i, line in enumerate(lines):
        m = re.match(r"(#+)\s+(.*)", line)
        if m and m.group(2).strip() == heading:
            start, level = i + 1, len(m.group(1))
            break
    if start is None:
        raise ValueError(f"{path}: no heading {heading!r}")
    blocks, cur, fence = [], None, False
    for line in lines[start:]:
        m = re.match(r"(#+)\s", line)
        if not fence and m and len(m.group(1)) <= level:
            break
        if line.startswith("```"):
            if fence:
                if cur is not None:
                    blocks.append("\n".join(cur) + "\n")
                cur, fence = None, False
            else:
                fence, cur = True, ([] if line.strip() == "```python" else None)
            continue
        if fence and cur is not None:
            cur.append(line)
    return blocks
