"""The notebook's case through independent backends (issue 31): one decoder layer of a
transformers Llama stack, captured once by ``scan_layers`` in Core ATen, its forward and
backward exported, compiled once by a backend, and run in a loop over the layers (forward over
the stack, backward in reverse) from the compiled programs alone; the output and every layer's
gradients equal the eager loop."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import aotgrad
from aotgrad.backends import BACKENDS
from test_scan_layers import _decoder_stack, _through


def _compile(backend):
    if backend == "torch":  # the plumbing alone, bit for bit
        return lambda program: program.module()
    module = pytest.importorskip(BACKENDS[backend])
    return module.compile_program


def _named_extras(args, kwargs):
    """The body's names of the layers' extra tensors (docs/scan.md: ``x[1]['...']``)."""
    named = {f"args[{i}]": a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            named[key] = value
        elif isinstance(value, tuple):
            named.update({f"{key}[{i}]": v for i, v in enumerate(value)})
    return named


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param("onnxruntime", marks=pytest.mark.backends),
        pytest.param("iree", marks=[pytest.mark.backends, pytest.mark.backends_slow]),
    ],
)
def test_llama_decoder_layer_compiled_once_and_run_in_a_loop(backend):
    layers, hidden, args, kwargs, _ = _decoder_stack("llama")
    eager_layers = copy.deepcopy(layers)
    options = dict(layer_kwargs=kwargs, decompositions="core_aten")
    aotgrad.scan_layers(layers, hidden.clone().requires_grad_(), *args, **options).sum().backward()
    body = aotgrad.scan_layers_function(layers, *args, **options)  # its one capture
    assert body.captures == 1
    programs = body.traced.export(flat=True)
    compile_program = _compile(backend)
    forward, backward = compile_program(programs.forward), compile_program(programs.backward)

    extras = _named_extras(args, kwargs)
    inputs = []  # per position: "carry", a parameter's name, or an extra tensor
    for desc in map(str, programs.forward_inputs):
        if desc == "carry":
            inputs.append(desc)
            continue
        which, name = re.fullmatch(r"x\[(\d)\]\['(.+)'\]", desc).groups()  # type: ignore[union-attr]
        inputs.append(name if which == "0" else extras[name])
    kinds = [type(d).__name__ for d in programs.forward_outputs]
    assert kinds[0] == "Output" and set(kinds[1:]) == {"Saved"}
    grads_of = [str(g.of) for g in programs.backward_outputs]
    assert grads_of[0] == "carry"

    with torch.no_grad():  # the backend's loop: the compiled programs alone
        carry, saved = hidden, []
        for layer in layers:
            params = dict(layer.named_parameters())
            row = [
                carry if i == "carry" else params[i] if isinstance(i, str) else i for i in inputs
            ]
            carry, *values = forward(*row)
            saved.append(values)
        out = carry
        grad, grads = torch.ones_like(out), []
        for values in reversed(saved):
            grad, *rest = backward(*values, grad)
            grads.append(dict(zip(grads_of[1:], rest, strict=True)))
        grads.reverse()

    x = hidden.clone().requires_grad_()
    expected = _through(eager_layers, x, args, kwargs)
    expected.sum().backward()
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, expected.detach(), **tol)
    torch.testing.assert_close(grad, x.grad, **tol)
    for layer, layer_grads in zip(eager_layers, grads, strict=True):
        for name, param in layer.named_parameters():
            got = layer_grads[f"x[0]['{name}']"]
            torch.testing.assert_close(got, param.grad, msg=name, **tol)
