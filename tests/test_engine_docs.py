"""The runnable examples in the engine's docstrings stay true."""

from __future__ import annotations

import doctest

import pytest

from pyhf_gpu_server.engine import compiled, interpolation, model


@pytest.mark.parametrize("module", [compiled, interpolation, model], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    failures, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert attempted > 0 and failures == 0
