"""The prefetch graph: which swap group's backward brings which group's tensors back.

One node per swap group, named by the module's FQN; one edge ``trigger -> target``
(``kind="prefetch"``) per scheduled prefetch. Exports are deterministic (I9): nodes in
forward order, edges sorted, every id and value quoted, so a diff of two dumps is a
diff of two schedules.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from typing import TYPE_CHECKING, Any

import networkx as nx

from graphswap.errors import GraphswapError

if TYPE_CHECKING:
    from graphswap.runtime import SwapManager

RENDER_FORMATS: tuple[str, ...] = ("svg", "png")

_LAYER_IN_FQN = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class PrefetchGraphError(GraphswapError, ValueError):
    """The prefetch schedule breaks an invariant of the swap runtime, or its graph was
    asked for in a format graphswap does not write."""


class GraphvizError(GraphswapError, RuntimeError):
    """Graphviz could not render the prefetch graph to an image."""


class GraphvizNotFoundError(GraphvizError):
    """Rendering to an image needs Graphviz's ``dot`` executable."""


def layer_index(fqn: str, default: int) -> int:
    """The decoder layer number in an FQN like ``model.layers.7.self_attn``."""
    found = _LAYER_IN_FQN.search(fqn)
    return int(found.group(1)) if found else default


def build_prefetch_graph(manager: SwapManager) -> nx.DiGraph:
    """Build and check the graph of ``manager``'s groups and prefetch schedule."""
    graph = nx.DiGraph()
    for group in manager.groups():
        graph.add_node(
            group.name,
            index=group.index,
            layer=layer_index(group.name, group.index),
            module_type=group.module_type,
            policy=group.policy,
            keep_on_device=group.keep_on_device,
        )
    for trigger, target in manager.prefetch_schedule():
        for name in (trigger, target):
            if name not in graph:
                raise PrefetchGraphError(
                    f"prefetch ({trigger!r} -> {target!r}) names {name!r}, "
                    "which is not a registered swap group"
                )
        if graph.has_edge(trigger, target):
            raise PrefetchGraphError(f"prefetch {trigger!r} -> {target!r} is scheduled twice")
        graph.add_edge(trigger, target, kind="prefetch")
    check_prefetch_graph(graph)
    return graph


def check_prefetch_graph(graph: nx.DiGraph) -> None:
    """Acyclic; each target prefetched once; a trigger runs its backward before its
    target's, so it comes later in forward order."""
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise PrefetchGraphError(f"prefetch graph has a cycle: {cycle}")
    for target in graph:
        triggers = sorted(graph.predecessors(target))
        if len(triggers) > 1:
            raise PrefetchGraphError(
                f"{target!r} is prefetched {len(triggers)} times (by {triggers}); "
                "each group must come back exactly once"
            )
    for trigger, target in graph.edges:
        if graph.nodes[trigger]["index"] <= graph.nodes[target]["index"]:
            raise PrefetchGraphError(
                f"{trigger!r} (forward index {graph.nodes[trigger]['index']}) cannot "
                f"prefetch {target!r} (forward index {graph.nodes[target]['index']}): "
                "a trigger must come later in forward order than its target"
            )


def _ordered_nodes(graph: nx.DiGraph) -> list[str]:
    return sorted(graph, key=lambda n: (graph.nodes[n]["index"], n))


def _ordered_edges(graph: nx.DiGraph) -> list[tuple[str, str]]:
    index = {n: graph.nodes[n]["index"] for n in graph}
    return sorted(graph.edges, key=lambda e: (index[e[1]], index[e[0]], e))


def graph_to_dict(graph: nx.DiGraph) -> dict[str, Any]:
    """``networkx.node_link_data`` layout (``edges`` key), in a fixed order."""
    return {
        "directed": True,
        "multigraph": False,
        "graph": dict(sorted(graph.graph.items())),
        "nodes": [{"id": n, **dict(sorted(graph.nodes[n].items()))} for n in _ordered_nodes(graph)],
        "edges": [
            {"source": s, "target": t, **dict(sorted(graph.edges[s, t].items()))}
            for s, t in _ordered_edges(graph)
        ],
    }


def to_json(graph: nx.DiGraph) -> str:
    return json.dumps(graph_to_dict(graph), indent=2, sort_keys=True) + "\n"


def _escape(value: object) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _quote(value: object) -> str:
    return f'"{_escape(value)}"'


def _attrs(items: dict[str, object]) -> str:
    return ", ".join(f"{key}={_quote(value)}" for key, value in items.items())


def _node_label(graph: nx.DiGraph, node: str) -> str:
    data = graph.nodes[node]
    kept = "kept on device" if data["keep_on_device"] else "swapped"
    parts = (node, data["module_type"].rpartition(".")[2], f"{data['policy']}, {kept}")
    # Joined by a literal backslash-n: DOT's line break inside a quoted label.
    return '"' + "\\n".join(_escape(part) for part in parts) + '"'


def to_dot(graph: nx.DiGraph, *, name: str = "prefetch") -> str:
    """Graphviz DOT text; byte-identical for equal graphs."""
    lines = [
        f"digraph {_quote(name)} {{",
        '  graph [rankdir="TB", label="edge: when the backward of the tail begins, '
        'the head comes back"];',
        '  node [shape="box", fontname="Helvetica"];',
        '  edge [color="steelblue"];',
    ]
    for node in _ordered_nodes(graph):
        data = graph.nodes[node]
        attrs = {key: data[key] for key in sorted(data)}
        style = {"style": "bold"} if data["keep_on_device"] else {}
        label = _node_label(graph, node)
        lines.append(f"  {_quote(node)} [{_attrs(attrs | style)}, label={label}];")
    for trigger, target in _ordered_edges(graph):
        attrs = dict(sorted(graph.edges[trigger, target].items()))
        lines.append(f"  {_quote(trigger)} -> {_quote(target)} [{_attrs(attrs)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(graph: nx.DiGraph, fmt: str) -> bytes:
    """Render through Graphviz's ``dot`` executable (``svg`` or ``png``)."""
    if fmt not in RENDER_FORMATS:
        raise PrefetchGraphError(
            f"cannot render {fmt!r}; image formats: {', '.join(RENDER_FORMATS)}"
        )
    dot = require_graphviz(fmt)
    result = subprocess.run(
        [dot, f"-T{fmt}"], input=to_dot(graph).encode(), capture_output=True, check=False
    )
    if result.returncode != 0:
        raise GraphvizError(
            f"Graphviz 'dot -T{fmt}' failed (exit {result.returncode}): "
            f"{result.stderr.decode(errors='replace').strip()}"
        )
    return result.stdout


def require_graphviz(fmt: str) -> str:
    """The path of ``dot``, or an error that names the package to install."""
    dot = shutil.which("dot")
    if dot is None:
        raise GraphvizNotFoundError(
            f"rendering {fmt} needs Graphviz's 'dot' program, which is not on PATH: "
            "install the graphviz package (apt install graphviz, brew install graphviz or "
            "conda install graphviz), or export DOT or JSON instead"
        )
    return dot
