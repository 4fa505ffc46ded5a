"""Every signature of a public function that the docs and the README show is the function's own."""
import inspect
import re
from pathlib import Path

import pytest

import allreduce_kit

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FUNCTIONS = ("allreduce", "average_arrays", "average_buffer", "broadcast_parameters", "iallreduce", "plan", "reduce_scatter",
             "allgather", "broadcast")


def shown(function) -> str:
    """``allreduce(buf, *, op="sum", ...)``: the signature as the docs write it (no annotations)."""
    parts, keyword_only = [], False
    for p in inspect.signature(function).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
            keyword_only = True
        default = "" if p.default is p.empty else "=" + (f'"{p.default}"' if isinstance(p.default, str)
                                                         else repr(p.default))
        parts.append(p.name + default)
    return f"{function.__name__}({', '.join(parts)})"


def displays(name: str):
    """(page, text) of each signature of ``name`` shown: a call spelled with ``comm=None`` is a
    signature (a usage example passes a communicator or leaves it out)."""
    for page in PAGES:
        for match in re.finditer(rf"\b{name}\(([^()]*)\)", page.read_text(encoding="utf-8")):
            if "comm=None" in match.group(1):
                yield page.relative_to(ROOT), match.group(0)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_every_signature_the_docs_show_is_the_real_one(name):
    real = shown(getattr(allreduce_kit, name))
    found = list(displays(name))
    assert found, f"no page shows the signature of {name}"
    for page, text in found:
        assert text == real, f"{page} shows {text}; the function is {real}"
