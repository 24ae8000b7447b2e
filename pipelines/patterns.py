"""Module-path patterns, as schemes, block lists and LoRA adapters name modules: a glob
("layers.*.attn.q_proj"), or "re:" and a regular expression matched against the whole path."""
from __future__ import annotations

import fnmatch
import re
from typing import Callable


def module_matcher(pattern: str) -> Callable[[str], bool]:
    """A predicate on module paths; ValueError for an invalid regular expression."""
    if pattern.startswith("re:"):
        try:
            compiled = re.compile(pattern[3:])
        except re.error as err:
            raise ValueError(f"module pattern {pattern!r} is not a valid regular expression: "
                             f"{err}") from None
        return lambda path: compiled.fullmatch(path) is not None
    return lambda path: fnmatch.fnmatchcase(path, pattern)
