"""A node's descriptor is stored once, as the object; names and text are derived from it."""

from __future__ import annotations

import torch

import aotgrad
from aotgrad.report.document import show_document
from aotgrad.signature import Descriptor, Param


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(3, 3)

    def forward(self, carry):
        return self.fc1(carry["a"]).relu().sum()


def traced():
    return aotgrad.trace(Net(), {"a": torch.randn(2, 3)})


def _graphs(t):
    return [t.partitioned.joint.gm, t.forward, t.backward]


def test_each_node_holds_its_descriptor_object_once():
    for gm in _graphs(traced()):
        for node in gm.graph.nodes:
            if node.op not in ("placeholder", "output"):
                continue
            descs = node.meta["desc"] if node.op == "output" else [node.meta["desc"]]
            assert all(d is None or isinstance(d, Descriptor) for d in descs)
            texts = {str(d) for d in descs}
            copies = [k for k, v in node.meta.items() if k != "desc" and _mentions(v, texts)]
            assert not copies, f"{node.name} also stores its descriptor under {copies}"


def _mentions(value, texts):
    if isinstance(value, list | tuple):
        return any(_mentions(v, texts) for v in value)
    return isinstance(value, Descriptor) or (isinstance(value, str) and value in texts)


def test_placeholder_names_and_printed_comments_come_from_the_descriptor():
    forward = traced().forward
    placeholders = {n.name: n.meta["desc"] for n in forward.graph.nodes if n.op == "placeholder"}
    assert placeholders["fc1_weight"] == Param(name="fc1.weight")
    assert str(placeholders["carry_a"]) == "carry['a']"
    assert "carry_a,  # carry['a']" in forward.code
    assert "fc1_weight,  # param fc1.weight" in forward.code


def test_the_show_document_prints_descriptor_text():
    t = traced()
    nodes = show_document(t.partitioned)["graphs"]["forward"]
    by_name = {n["name"]: n["desc"] for n in nodes}
    assert by_name["carry_a"] == "carry['a']"
    (output,) = (n for n in nodes if n["op"] == "output")
    assert output["desc"] == [str(d) for d in t.signature.forward_outputs]
