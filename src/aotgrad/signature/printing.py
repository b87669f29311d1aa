"""Descriptors in the printed graph: each placeholder and output carries its descriptor.

The descriptor object is stored once, under ``node.meta["desc"]`` (a list of
them on the output node), where ``torch.fx`` prints it as a comment; text is
derived from it (``str(desc)``, :func:`placeholder_name`), never stored.

>>> import torch.fx as fx
>>> from aotgrad.signature.descriptors import Input, Output
>>> g = fx.Graph(); x = g.placeholder("x"); _ = g.output((x,))
>>> describe_graph(g, [Input(path="carry['a']")], [Output(path="[0]")])
>>> print(fx.GraphModule({}, g).code.strip())  # doctest: +NORMALIZE_WHITESPACE
def forward(
    self,
    x,  # carry['a']
):
    return (
        x,  # output[0]
    )
>>> x.meta["desc"]
Input(path="carry['a']")
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch.fx as fx

from aotgrad._torch_compat import ExpandedCodeGen
from aotgrad.signature.descriptors import (
    Buffer,
    Closure,
    Descriptor,
    Global,
    Inner,
    Input,
    InputBase,
    Param,
    StateAtBackward,
)

DESC_KEY = "desc"  # torch.fx prints node.meta["desc"] as a comment when expanding defs


def describe_graph(
    graph: fx.Graph, inputs: Sequence[Descriptor], outputs: Sequence[Descriptor | None]
) -> None:
    """Attach descriptors to ``graph``'s placeholders and outputs, in place.

    A ``GraphModule`` built on (or recompiled after) this prints them.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, desc in zip(placeholders, inputs, strict=True):
        node.meta[DESC_KEY] = desc
    output = graph.output_node()
    if len(output.args[0]) != len(outputs):  # type: ignore[arg-type]
        raise AssertionError(f"expected {len(outputs)} outputs, got {len(output.args[0])}")  # type: ignore[arg-type]
    output.meta[DESC_KEY] = list(outputs)
    graph.set_codegen(ExpandedCodeGen())


def placeholder_name(desc: Descriptor) -> str:
    """A Python name for the graph input ``desc`` describes, from its parts.

    >>> placeholder_name(Input(path="carry['a']")), placeholder_name(Param(name="fc1.weight"))
    ('carry_a', 'fc1_weight')
    >>> placeholder_name(InputBase(of=(Input(path="x"), Input(path="args[1]"))))
    'base_of_x_args_1'
    >>> placeholder_name(Input(path="[0]"))
    '_0'
    """
    if isinstance(desc, Input):
        text = desc.path
    elif isinstance(desc, Param | Buffer | Closure | Global):
        text = desc.name
    elif isinstance(desc, Inner):  # Note [Tensor subclasses]
        text = f"{placeholder_name(desc.of)}_{desc.attr}"
    elif isinstance(desc, InputBase):
        text = "base_of_" + "_".join(str(d) for d in desc.of)
    elif isinstance(desc, StateAtBackward):  # Note [State updated by the backward]
        text = f"{placeholder_name(desc.of)}_at_backward"
    else:
        text = str(desc)
    name = re.sub(r"\W+", "_", text).strip("_") or "input"
    return name if not name[0].isdigit() else f"_{name}"
