"""A model built on ``meta`` is captured and planned as the same model on CPU (issue 42, item 4).

The peak a user reads before renting a machine comes from a model that was never allocated:
these tests hold its graphs, saved values and predicted peak to those of the same model with
real CPU tensors, and check that no parameter memory is allocated on the way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import aotgrad
import library_models  # noqa: F401  (the torchvision shim, before transformers)
from aotgrad.partition import Budget
from aotgrad.partition.memory import predict_peak

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent


def _llama(device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A 2-layer Llama with grouped key/value heads; eager attention, which both devices run
    alike (``sdpa`` picks its kernel by device: docs/memory.md)."""
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        attn_implementation="eager",
        use_cache=False,
    )
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).to(dtype).train()


def _trace(device: str, dtype: torch.dtype, partition: Any) -> aotgrad.Traced:
    model = _llama(device, dtype)
    ids = torch.arange(32, device=device).remainder(128).reshape(2, 16)
    return aotgrad.trace(
        lambda ids: model(input_ids=ids, labels=ids).loss, ids, partition=partition
    )


def _code(gm: torch.fx.GraphModule) -> str:
    return gm.code.replace("device(type='meta')", "device(type='cpu')")


def _same_plan(meta: aotgrad.Traced, cpu: aotgrad.Traced) -> None:
    m, c = meta.partitioned, cpu.partitioned
    assert m.backward is not None and c.backward is not None
    assert _code(m.forward) == _code(c.forward)
    assert _code(m.backward) == _code(c.backward)
    assert [(s.name, s.nbytes) for s in m.saved] == [(s.name, s.nbytes) for s in c.saved]
    assert m.recompute_flops == c.recompute_flops
    assert len(m.saved) > 10  # a plan that saves activations, not only the inputs


@pytest.mark.parametrize("partition", ["save_all", "mincut", aotgrad.budget(peak=480_000)])
def test_meta_plan_and_peak_equal_cpu(partition: Any) -> None:
    """float32, where no CPU kernel of this model takes scratch space: the same graphs, the same
    saved values and the same predicted peak, byte for byte, under every kind of plan."""
    meta, cpu = _trace("meta", torch.float32, partition), _trace("cpu", torch.float32, partition)
    _same_plan(meta, cpu)
    assert not [v for v in cpu.partitioned.peak.live if v.kind == "workspace"]
    assert meta.partitioned.peak.to_dict() == cpu.partitioned.peak.to_dict()
    assert meta.partitioned.peak.nbytes > meta.partitioned.peak.inputs > 0
    if isinstance(partition, Budget):  # a plan that recomputes, below save_all's peak
        assert meta.partitioned.recompute_flops > 0


def test_meta_peak_leaves_out_scratch_space() -> None:
    """bf16: a CPU matmul's scratch space is measured by running it (Note [Measured scratch
    space]); on meta nothing runs, so the meta peak is the CPU peak without scratch space."""
    meta, cpu = (
        _trace("meta", torch.bfloat16, "save_all"),
        _trace("cpu", torch.bfloat16, "save_all"),
    )
    _same_plan(meta, cpu)
    c = cpu.partitioned
    assert c.backward is not None
    without = predict_peak(c.forward, c.backward, c.signature)
    assert meta.partitioned.peak.to_dict() == without.to_dict()
    assert not [v for v in meta.partitioned.peak.live if v.kind == "workspace"]


def test_meta_model_through_aot_module() -> None:
    """The way users call it: aot_module on the meta model, a step, ``.backward()``; the plan
    is trace's, and every parameter and gradient stays on meta."""
    model = _llama("meta", torch.bfloat16)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    step = aotgrad.aot_module(model, partition="mincut")
    step(input_ids=ids, labels=ids).loss.backward()
    assert step.partitioned is not None
    # Its outputs (the logits too) are held to the end of the step, as trace's of the module.
    again = _llama("meta", torch.bfloat16)
    traced = aotgrad.trace(again, input_ids=ids, labels=ids, partition="mincut")
    assert step.partitioned.peak.to_dict() == traced.partitioned.peak.to_dict()
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.grad.device.type for p in model.parameters() if p.grad is not None} == {"meta"}
    assert all(p.grad is not None for p in model.parameters())


_CHILD = """
import json, resource, sys
sys.path.insert(0, "tests")
import library_models
import torch, aotgrad
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=2,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                     attn_implementation="eager", use_cache=False)
with torch.device("meta"):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
traced = aotgrad.trace(lambda ids: model(input_ids=ids, labels=ids).loss, ids, partition="mincut")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
p = traced.partitioned
tensors = [*model.parameters(), *model.buffers()]
for gm in (p.forward, p.backward):
    tensors += [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
print(json.dumps({
    "params": sum(t.numel() * t.element_size() for t in model.parameters()),
    "grown": after - before,
    "devices": sorted({t.device.type for t in tensors}),
    "peak": p.peak.nbytes,
}))
"""


def test_meta_capture_allocates_no_parameter_memory() -> None:
    """A 1.3 GB (bf16) 2-layer Llama-7B-shaped model: capture and plan in a fresh process grow
    its peak RSS by far less than the parameters' bytes, every tensor left on meta, and the
    prediction counts the parameters the GPU would hold."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["params"] > 1.2e9
    assert found["grown"] < found["params"] / 8, found
    assert found["devices"] == ["meta"]
    assert found["peak"] > found["params"]


def _saved_shapes(attention: str) -> list[tuple[int, ...]]:
    sys.path.insert(0, str(ROOT / "bench"))
    import meta_scale

    model = meta_scale.build("llama7b", attention, layers=1)
    ids = torch.zeros(1, 256, dtype=torch.long, device="meta")
    traced = aotgrad.trace(lambda ids: model(input_ids=ids, labels=ids).loss, ids)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    return [tuple(s.shape) for s in traced.saved]


def test_attention_on_meta_is_the_kernel_it_names() -> None:
    """docs/memory.md's warning, pinned: HF's sdpa on meta takes the math path and saves the
    (1, 32, 256, 256) scores; bench/meta_scale.py's cuda_sdpa (the CUDA flash kernel) saves a
    logsumexp per row instead, and no tensor of sequence x sequence."""
    scores = (1, 32, 256, 256)
    assert scores in _saved_shapes("sdpa")
    flash = _saved_shapes("cuda_sdpa")
    assert not [s for s in flash if s[-2:] == (256, 256)]
    assert (1, 32, 256) in flash  # the logsumexp
