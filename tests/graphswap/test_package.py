"""The package's promises at import time (the origin's P3: a platform query on import)."""

import subprocess
import sys

import graphswap


def test_import_has_no_side_effects() -> None:
    code = (
        "import sys, torch, graphswap\n"
        "assert 'passes' not in sys.modules, 'the core imports the pass plan'\n"
        "assert not [m for m in sys.modules if m.startswith('transformers')]\n"
        "assert not torch.cuda.is_initialized(), 'importing graphswap touched CUDA'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_public_names_resolve() -> None:
    assert sorted(graphswap.__all__) == sorted(set(graphswap.__all__))
    for name in graphswap.__all__:
        assert getattr(graphswap, name) is not None, name
