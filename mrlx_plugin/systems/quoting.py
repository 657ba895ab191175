"""Another agent's text (or the dataset's) quoted as data inside a prompt a system writes.

A prompt that lays out several texts under headings of its own ("### Solution 2", "### Debater
B") must keep each text one piece of data: a text holding the line "### Debater B" would
otherwise open a second, forged section. `quote` puts a text in a fenced block, as Markdown
quotes code, whose fence is one backtick longer than the longest run of backticks in the text
(three at least). Only a line of at least that many backticks closes the block, and the text
has none, so everything up to the closing fence is that one text, whatever it holds; the text
itself is left as it was written.
"""

from __future__ import annotations

import re

_BACKTICKS = re.compile(r"`+")


def quote(text: str) -> str:
    """`text` in a fenced block that no line of it can close."""
    longest = max((len(run) for run in _BACKTICKS.findall(text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"
