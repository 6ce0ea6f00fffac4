"""Every registered backend lowers every op of the table, or states its fallback.

Data-driven over `backends.BACKENDS`: a backend described there with its table
is checked here with no edit of this file. A new op in ir/ops.py fails this test until
each backend says how it lowers it.
"""

import pytest

from tilegraph.backends import BACKENDS
from tilegraph.backends.lowering import DECOMPOSE, TEMPLATE, Fallback, lowerings, missing
from tilegraph.ir.ops import ELEMWISE, OPS


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_op_has_a_lowering_or_a_stated_fallback(backend):
    lowered = lowerings(backend)
    assert not missing(lowered), f"the {backend} backend has no lowering and no stated fallback for " \
                                 + ", ".join(f"tg.{n}" for n in missing(lowered))
    assert set(lowered) <= set(OPS), f"{backend} lowers ops the table lacks: {sorted(set(lowered) - set(OPS))}"
    for name, how in lowered.items():
        assert how in (TEMPLATE, DECOMPOSE) or (isinstance(how, Fallback) and how.reason.strip()), (name, how)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_what_a_backend_decomposes_has_a_decomposition(backend):
    from tilegraph.ir.decompositions import DECOMPOSITIONS

    undefined = [n for n, how in lowerings(backend).items() if how == DECOMPOSE and n not in DECOMPOSITIONS]
    assert not undefined, f"{backend} decomposes {undefined}, which the decomposition library does not spell out"


def test_a_removed_lowering_is_reported():
    lowered = dict(lowerings("numpy"))
    del lowered["softmax"]
    assert missing(lowered) == ["softmax"]


def test_triton_templates_back_its_elementwise_lowerings():
    from tilegraph.backends.triton.lowering import TRITON

    # trilu is written by the row kernel itself (it reads the column index).
    templated = [n for n, how in lowerings("triton").items() if how == TEMPLATE and OPS[n].pattern == ELEMWISE]
    assert [n for n in templated if n not in TRITON] == []


def test_onnx_templates_have_an_exporter():
    from tilegraph.backends.onnx_export import TEMPLATES

    assert {n for n, how in lowerings("onnx").items() if how == TEMPLATE} == set(TEMPLATES)
