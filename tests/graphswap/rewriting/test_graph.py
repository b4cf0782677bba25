"""The prefetch graph: invariants, deterministic DOT (golden) and JSON export, rendering."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import stat
from pathlib import Path

import networkx as nx
import pydot
import pytest

from graphswap.hf.checkpoints import build_model
from graphswap.hf.presets import qwen3_moe_config
from graphswap.rewriting.apply import rewrite
from graphswap.rewriting.graph import (
    GraphvizNotFoundError,
    PrefetchGraphError,
    build_prefetch_graph,
    check_prefetch_graph,
    graph_to_dict,
    layer_index,
    render,
    to_dot,
    to_json,
)
from graphswap.runtime import GroupInfo

GOLDEN = Path(__file__).parent / "golden" / "prefetch_graph_default.dot"
"""DOT of the 48-layer ``graph-default`` model; regenerate with GRAPHSWAP_UPDATE_GOLDEN=1."""

# pydot's parser still calls pyparsing's camelCase API.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pydot.*")


class FakeManager:
    """The two SwapManager methods the graph reads, with arbitrary contents."""

    def __init__(self, names: list[str], schedule: list[tuple[str, str]]) -> None:
        self._groups = [
            GroupInfo(name, i, "pkg.Attention", "policy", i == len(names) - 1)
            for i, name in enumerate(names)
        ]
        self._schedule = schedule

    def groups(self) -> list[GroupInfo]:
        return self._groups

    def prefetch_schedule(self) -> list[tuple[str, str]]:
        return self._schedule


def default_graph(layers: int = 48) -> nx.DiGraph:
    config = qwen3_moe_config("graph-default", num_hidden_layers=layers)
    return rewrite(build_model(config, device="meta"), "attn_swap").graph


def test_graph_nodes_and_edges_follow_the_manager() -> None:
    graph = default_graph(4)
    assert list(graph) == [f"model.layers.{i}.self_attn" for i in range(4)]
    assert graph.nodes["model.layers.2.self_attn"] == {
        "index": 2,
        "layer": 2,
        "module_type": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention",
        "policy": "swap_large_activations",
        "keep_on_device": False,
    }
    assert graph.nodes["model.layers.3.self_attn"]["keep_on_device"] is True
    assert sorted(graph.edges(data="kind")) == [
        ("model.layers.1.self_attn", "model.layers.0.self_attn", "prefetch"),
        ("model.layers.2.self_attn", "model.layers.1.self_attn", "prefetch"),
        ("model.layers.3.self_attn", "model.layers.2.self_attn", "prefetch"),
    ]


def test_dot_matches_the_golden_file_and_parses() -> None:
    dot = to_dot(default_graph(48))
    if os.environ.get("GRAPHSWAP_UPDATE_GOLDEN"):
        GOLDEN.write_text(dot)
    assert dot == GOLDEN.read_text()
    (parsed,) = pydot.graph_from_dot_data(dot)
    nodes = [n for n in parsed.get_nodes() if n.get_name().startswith('"model.')]
    assert len(nodes) == 48
    edges = parsed.get_edges()
    assert len(edges) == 47
    assert {e.get("kind") for e in edges} == {'"prefetch"'}
    first = edges[0]
    assert (first.get_source(), first.get_destination()) == (
        '"model.layers.1.self_attn"',
        '"model.layers.0.self_attn"',
    )


def test_exports_are_byte_identical_across_builds() -> None:
    a, b = default_graph(5), default_graph(5)
    assert to_dot(a) == to_dot(b)
    assert to_json(a) == to_json(b)


def test_dot_does_not_depend_on_insertion_order() -> None:
    graph = default_graph(3)
    shuffled = nx.DiGraph()
    for node in reversed(list(graph)):
        shuffled.add_node(node, **dict(reversed(list(graph.nodes[node].items()))))
    shuffled.add_edges_from(reversed(list(graph.edges(data=True))))
    assert to_dot(shuffled) == to_dot(graph)


def test_dot_quotes_awkward_names() -> None:
    graph = build_prefetch_graph(FakeManager(['a "quoted" name', "node", "b\\c"], []))
    (parsed,) = pydot.graph_from_dot_data(to_dot(graph))
    names = {n.get_name() for n in parsed.get_nodes()}
    assert {'"a \\"quoted\\" name"', '"node"', '"b\\\\c"'} <= names


def test_json_is_node_link_data() -> None:
    graph = default_graph(3)
    data = json.loads(to_json(graph))
    assert data == graph_to_dict(graph)
    # networkx 3.4 renamed node_link_graph's ``link`` keyword to ``edges``.
    keyword = "edges" if "edges" in inspect.signature(nx.node_link_graph).parameters else "link"
    back = nx.node_link_graph(data, **{keyword: "edges"})
    assert nx.utils.graphs_equal(back, graph)


def test_layer_index_from_fqn() -> None:
    assert layer_index("model.layers.7.self_attn", 0) == 7
    assert layer_index("layers.12", 0) == 12
    assert layer_index("decoder.block.3.attn", 5) == 5
    assert layer_index("model.sublayers.2.attn", 9) == 9


@pytest.mark.parametrize(
    ("names", "schedule", "message"),
    [
        (["a", "b"], [("b", "x")], "'x', which is not a registered swap group"),
        (["a", "b"], [("b", "a"), ("b", "a")], "scheduled twice"),
        (["a", "b", "c"], [("b", "a"), ("c", "a")], r"'a' is prefetched 2 times"),
        (["a", "b"], [("a", "b")], "must come later in forward order"),
        (["a", "b"], [("a", "b"), ("b", "a")], "has a cycle"),
    ],
)
def test_broken_schedules_are_rejected(
    names: list[str], schedule: list[tuple[str, str]], message: str
) -> None:
    with pytest.raises(PrefetchGraphError, match=message):
        build_prefetch_graph(FakeManager(names, schedule))


def test_check_accepts_a_valid_graph() -> None:
    check_prefetch_graph(default_graph(3))


def test_render_without_graphviz_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(GraphvizNotFoundError, match="install the graphviz package"):
        render(default_graph(2), "svg")
    with pytest.raises(ValueError, match="cannot render 'pdf'"):
        render(default_graph(2), "pdf")


def test_render_pipes_dot_through_graphviz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dot = tmp_path / "dot"
    fake_dot.write_text('#!/bin/sh\necho "rendered $1"\ncat\n')
    fake_dot.chmod(fake_dot.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    graph = default_graph(2)
    assert render(graph, "png") == b"rendered -Tpng\n" + to_dot(graph).encode()


@pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz's dot")
def test_render_svg_with_real_graphviz() -> None:
    assert b"<svg" in render(default_graph(2), "svg")
