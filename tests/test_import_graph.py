"""No import circles in the product (issue 53): tests/import_graph.py on the checkout, and on
small trees of its own that prove it finds a circle (through a lazy import too) and leaves
`if TYPE_CHECKING:` imports out."""

from __future__ import annotations

from pathlib import Path

from tests import import_graph

ROOMS = ("cluster", "launch")


def test_the_product_has_no_import_circle():
    assert import_graph.find_circles() == []


def test_the_checker_reads_the_whole_product():
    graph = import_graph.import_graph()
    assert {
        "torch_multinode",
        "torch_multinode.cluster.inventory",
        "torch_multinode.launch.cli",
        "torch_multinode.training.ddp",
        "torch_multinode.bench.cli",
    } <= set(graph)
    # an import in a function counts: cluster.cli imports provision.bootstrap in _ready
    assert "torch_multinode.provision.bootstrap" in graph["torch_multinode.cluster.cli"]
    # the model imports none of the inventory's reading or checking
    assert (
        not {
            "torch_multinode.cluster.inventory_read",
            "torch_multinode.cluster.inventory_checks",
            "torch_multinode.cluster.inventory_validate",
        }
        & graph["torch_multinode.cluster.inventory"]
    )


def tree(root: Path, files: dict[str, str]) -> Path:
    """The files under `root` (paths relative to it, each room a package), and `root`."""
    for name, text in {**dict.fromkeys(f"{room}/__init__.py" for room in ROOMS), **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text or "")
    return root


def test_a_circle_through_a_lazy_import_is_found_and_said_as_one_line(tmp_path):
    root = tree(
        tmp_path,
        {
            "cluster/a.py": "from torch_multinode.cluster import b\n",
            "cluster/b.py": "import os\n\n\ndef later():\n"
            "    from torch_multinode.cluster.c import name\n    return name\n",
            "cluster/c.py": "from torch_multinode.cluster.a import anything\nname = 1\n",
            "cluster/d.py": "from torch_multinode.cluster import a, c\n",  # into it, not on it
        },
    )
    assert import_graph.find_circles(root, ROOMS) == [
        "cluster/a.py -> cluster/b.py -> cluster/c.py -> cluster/a.py"
    ]


def test_type_checking_imports_do_not_count_and_relative_ones_do(tmp_path):
    root = tree(
        tmp_path,
        {
            "cluster/model.py": "from typing import TYPE_CHECKING\n\n"
            "if TYPE_CHECKING:\n    from torch_multinode.cluster.check import Checked\n"
            "else:\n    from . import base\n",
            "cluster/check.py": "from torch_multinode.cluster.model import Model\n",
            "cluster/base.py": "",
        },
    )
    graph = import_graph.import_graph(root, ROOMS)
    assert graph["torch_multinode.cluster.model"] == {"torch_multinode.cluster.base"}
    assert import_graph.find_circles(root, ROOMS) == []

    (root / "cluster" / "base.py").write_text("from ..cluster import check\n")
    assert import_graph.find_circles(root, ROOMS) == [
        "cluster/base.py -> cluster/check.py -> cluster/model.py -> cluster/base.py"
    ]


def test_every_circle_is_its_own_line_and_each_names_every_file_of_it(tmp_path):
    root = tree(
        tmp_path,
        {
            "cluster/a.py": "import torch_multinode.cluster.b\nimport torch_multinode.cluster.c\n",
            "cluster/b.py": "from torch_multinode.cluster import a\n",
            "cluster/c.py": "from torch_multinode.cluster import a\n",
            "launch/x.py": "from torch_multinode.launch import y\n",
            "launch/y.py": "from torch_multinode.launch.x import run\n",
        },
    )
    assert import_graph.find_circles(root, ROOMS) == [
        "cluster/a.py -> cluster/b.py -> cluster/a.py -> cluster/c.py -> cluster/a.py",
        "launch/x.py -> launch/y.py -> launch/x.py",
    ]


def test_main_says_the_circles_and_exits_1_else_a_summary_and_0(tmp_path, capsys):
    assert import_graph.main() == 0
    assert capsys.readouterr().out.endswith(" imports, no circles\n")

    root = tree(
        tmp_path,
        {
            "cluster/a.py": "from torch_multinode.cluster import b\n",
            "cluster/b.py": "from torch_multinode.cluster import a\n",
        },
    )
    assert import_graph.main(root, ROOMS) == 1
    assert capsys.readouterr().out.splitlines() == [
        "1 import circle(s) in the product (tests/import_graph.py):",
        "  cluster/a.py -> cluster/b.py -> cluster/a.py",
    ]
