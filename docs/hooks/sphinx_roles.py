"""A griffe extension for the API pages: the docstrings cite code with Sphinx roles
(``:class:`~graphswap.runtime.timeline.StepTimeline```), which Markdown would print as
they are. Each role becomes inline code of the name it shows, as Sphinx would render
it: the last part after ``~``, the whole path otherwise."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:attr|class|data|exc|func|meth|mod|obj):`(~?)\.?([\w.]+)(?:\(\))?`")


def _shown(match: re.Match[str]) -> str:
    tilde, path = match.groups()
    return f"`{path.rsplit('.', 1)[-1] if tilde else path}`"


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_shown, obj.docstring.value)
