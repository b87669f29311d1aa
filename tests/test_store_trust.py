"""What a graph file or a cache entry can make aotgrad do: compute its graphs, nothing more
(Note [Files run no code], Note [Tree structure in a file], Note [Ops a file may run],
Note [User text in code])."""

from __future__ import annotations

import collections
import copy
import hashlib
import json
import sys
import textwrap
from typing import NamedTuple

import pytest
import torch

import aotgrad
from aotgrad.cli import main
from aotgrad.errors import CallError, StoreError
from aotgrad.ops.file_ops import refusal
from aotgrad.runtime.straight_line import straight_line_source


def _rewrite(path, edit):
    """Edit the three lines of a graph file as data, and fix its length and checksum as a
    careful attacker would."""
    head, run, about = path.read_bytes().split(b"\n")
    header, run, about = json.loads(head), json.loads(run), json.loads(about)
    edit(header, run, about)
    _write(path, header, json.dumps(run).encode() + b"\n" + json.dumps(about).encode())


def _write(path, header, payload):
    header["bytes"], header["sha256"] = len(payload), hashlib.sha256(payload).hexdigest()
    path.write_bytes(json.dumps(header).encode() + b"\n" + payload)


def _saved(tmp_path, fn=lambda x: x.sin() * 2, *args):
    path = tmp_path / "f.aotgrad"
    aotgrad.trace(fn, *(args or (torch.ones(3, requires_grad=True),))).save(path)
    return path


# -- 1. tree structure: no type is ever imported by name -----------------------------------

_IMPORTING_SPECS = [
    # torch's treespec format, as version 2 files held it: each names a module to import.
    json.dumps(
        [
            1,
            {
                "type": "builtins.tuple",
                "context": json.dumps({"__enum__": 1, "fqn": "tabnanny:x", "name": "a"}),
                "children_spec": [],
            },
        ]
    ),
    ["named", {"type": "tabnanny.Fly", "context": None}, []],
    ["tabnanny.Fly", None, []],
    ["defaultdict", ["tabnanny.fly", []], []],
    ["return_types", "__loader__", []],
    ["dict", [{"type": "Popen", "fields": {}}], [None]],
]


@pytest.mark.parametrize("spec", _IMPORTING_SPECS)
def test_a_call_structure_naming_a_module_imports_nothing(tmp_path, spec):
    path = _saved(tmp_path)
    _rewrite(path, lambda h, r, a: r["call"].update(spec=spec))
    sys.modules.pop("tabnanny", None)
    try:
        loaded = aotgrad.load(path)
    except StoreError:
        pass
    else:  # the spec is only compared with the caller's: no call matches it
        with pytest.raises(CallError, match=r"structured otherwise|containers differ"):
            loaded(torch.ones(3, requires_grad=True))
    assert "tabnanny" not in sys.modules


@pytest.mark.parametrize(
    "structure",
    [
        {"structure": ["named", {"type": "tabnanny.Fly", "context": None}, []]},
        {"structure": ["tabnanny.Fly", None, [None]]},
        {"structure": ["defaultdict", ["tabnanny.fly", []], []]},
        {"structure": ["return_types", "__loader__", []]},
        {"structure": ["deque", -1, []]},
        {"structure": ["dict", ["a", "a"], [None, None]]},
        {"structure": ["dict", [{"tuple": [[1]]}], [None]]},
        {
            "treespec": json.dumps(
                [1, {"type": "builtins.tuple", "context": "null", "children_spec": []}]
            )
        },
    ],
)
def test_a_result_structure_naming_anything_else_is_a_store_error(tmp_path, structure):
    path = _saved(tmp_path)
    _rewrite(path, lambda h, r, a: r["plan"]["fields"].update(out_spec=structure))
    sys.modules.pop("tabnanny", None)
    with pytest.raises(StoreError):
        aotgrad.load(path)
    assert "tabnanny" not in sys.modules


@pytest.mark.parametrize(
    "evil",
    [
        {"treespec": _IMPORTING_SPECS[0]},  # torch's format, read by treespec_loads before
        {"structure": ["named", {"type": "tabnanny.Fly", "context": None}, []]},
    ],
)
def test_a_cache_entry_whose_structure_names_a_module_is_a_miss(cache_dir, evil):
    def f(x):
        return x.cos() + 1

    x = torch.randn(3, requires_grad=True)
    aotgrad.aot_function(f)(x)
    (entry,) = sorted(cache_dir.glob("*/*.aotgrad"))
    _rewrite(entry, lambda h, r, a: r["plan"]["fields"].update(out_spec=evil))
    sys.modules.pop("tabnanny", None)
    again = aotgrad.aot_function(f)
    torch.testing.assert_close(again(x), f(x))
    assert aotgrad.cache_info(again).disk_hits == 0
    assert "tabnanny" not in sys.modules


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def _containers(d, od, dd, dq, pair):
    return {
        "sum": d["w"] * od["v"] + dd["k"][0] + dq[0] + pair.a * pair.b,
        "list": [d["w"].sin(), (od["v"].cos(),)],
        "max": torch.max(pair.b.reshape(1, 3), 1),
    }


def test_the_allowed_containers_round_trip(tmp_path):
    t = lambda: torch.randn(3, requires_grad=True)  # noqa: E731
    torch.manual_seed(0)
    args = (
        {"w": t()},
        collections.OrderedDict(v=t()),
        collections.defaultdict(list, {"k": [t()]}),
        collections.deque([t()], maxlen=4),
        Pair(t(), t()),
    )
    path = tmp_path / "c.aotgrad"
    aotgrad.trace(_containers, *args).save(path)
    loaded = aotgrad.load(path)
    got, expected = loaded(*args), _containers(*args)
    assert type(got["max"]) is torch.return_types.max
    torch.testing.assert_close(got, expected)
    other = Pair(*args[-1])._asdict()  # the same tensors in another structure
    with pytest.raises(CallError, match=r"structured otherwise|containers differ"):
        loaded(*args[:-1], other)


# -- 2. the ops a file may run --------------------------------------------------------------


def _add_node(run, about, target, args, kwargs=None, *, use=False):
    """Append a node calling ``target`` before the forward's output; ``use``: the output
    returns it in place of its first value."""
    graph = run["forward"]
    graph["targets"].append(target)
    nodes = graph["nodes"]
    output = nodes.pop()
    nodes.append(["evil", "call_function", len(graph["targets"]) - 1, args, kwargs or {}])
    if use:
        output[3]["tuple"][0]["tuple"][0] = {"node": "evil"}
    nodes.append(output)
    for key in ("values", "infos", "descriptors"):
        about["forward"][key].insert(len(nodes) - 2, None)


def _x():
    return {"node": "x"}


@pytest.mark.parametrize(
    ("target", "args", "kwargs", "message"),
    [
        ("aten.from_file.default", ["{path}", True, 3], {"dtype": {"dtype": "float32"}}, "file"),
        ("aten._print.default", ["hello"], {}, "it prints"),
        ("aten._cufft_clear_plan_cache.default", [0], {}, "returns nothing"),
        ("aten.add_.Tensor", [_x(), _x()], {}, "writes its argument 'self'"),
        ("aten.mm.out", [_x(), _x()], {"out": _x()}, "writes its argument 'out'"),
        ("aten.resize_.default", [_x(), [10**9]], {}, "writes"),
        ("aten.uniform_.default", [_x()], {}, "writes"),
        ("aten._copy_from.default", [_x(), _x()], {}, "dst"),
        ("aten.copy_.default", [{"node": "sin"}, _x()], {}, "other than as aotgrad writes"),
        ("aten.copy_.default", [_x(), _x()], {"non_blocking": True}, "other than as aotgrad"),
        ("aten.set_.source_Storage", [_x(), _x()], {}, "writes"),
        ("prims.copy_to.default", [_x(), _x()], {}, "writes"),
        ("profiler._record_function_enter.default", ["x"], {}, "not an aten or prims op"),
        ("_c10d_functional.wait_tensor.default", [_x()], {}, "not an aten or prims op"),
    ],
)
def test_a_graph_file_may_not_run_ops_that_touch_the_world(tmp_path, target, args, kwargs, message):
    path = _saved(tmp_path, lambda x: x.sin() * 2)
    written = tmp_path / "written.bin"
    args = [str(written) if a == "{path}" else a for a in args]

    def edit(h, r, a):
        _add_node(r, a, target, {"tuple": args}, kwargs)
        r["forward"]["nodes"][0][0] = "x"  # the input, by a name the arguments use
        for node in r["forward"]["nodes"]:
            node[3] = json.loads(json.dumps(node[3]).replace('"x_1"', '"x"'))

    _rewrite(path, edit)
    with pytest.raises(StoreError, match=message) as raised:
        aotgrad.load(path)(torch.ones(3, requires_grad=True))
    assert target in str(raised.value)
    assert not written.exists()


def _update(buf, x):
    buf.add_(x)
    return x * 2


def test_copy_of_a_value_into_its_input_is_what_aotgrad_writes(cache_dir):
    x = torch.ones(3)
    aotgrad.aot_function(_update, keep_inference_input_mutations=True)(torch.zeros(3), x)
    (entry,) = sorted(cache_dir.glob("*/*.aotgrad"))
    assert '"aten.copy_.default"' in entry.read_text()
    again = aotgrad.aot_function(_update, keep_inference_input_mutations=True)
    mine = torch.zeros(3)
    again(mine, x)
    assert aotgrad.cache_info(again).disk_hits == 1
    assert mine.tolist() == [1.0, 1.0, 1.0]


def test_every_op_in_the_models_graphs_may_be_loaded():
    from models import GPT, MLP, ConvBN, DeepMLP

    for model, args in [
        (GPT(), (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))),
        (ConvBN(), (torch.randn(2, 1, 8, 8), torch.randn(2, 10))),
        (MLP(), (torch.randn(4, 16),)),
        (DeepMLP(width=8, depth=2), (torch.randn(4, 8),)),
    ]:
        traced = aotgrad.trace(model, *args)
        for gm in (traced.forward, traced.backward):
            for node in gm.graph.nodes:
                if isinstance(node.target, torch._ops.OpOverload):
                    assert refusal(node.target) is None, node.target


def test_save_refuses_what_a_file_may_not_run(tmp_path):
    # An op a user's graph may hold (a custom op): not stored, and the call still runs.
    @torch.library.custom_op("aotgrad_trust_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    twice.register_fake(lambda x: torch.empty_like(x))
    traced = aotgrad.trace(lambda x: twice(x) + 1, torch.ones(3))
    with pytest.raises(StoreError, match="not an aten or prims op"):
        traced.save(tmp_path / "custom.aotgrad")


# -- 3. user text never becomes code ----------------------------------------------------------

_KEYS = [
    "a\n):\n    pass\nimport aotgrad_trust_payload\nif (1",
    "b\r):\r    pass\rimport aotgrad_trust_payload\rif (1",
    "c\u2028x\x85y\x0bz\x0c\x1c\x1d\x1e\u2029",
    "d'\"\\\n#",
]


class Keyed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.d = torch.nn.ModuleDict({k: torch.nn.Linear(3, 3) for k in _KEYS})

    def forward(self, x):
        for key in _KEYS:
            x = self.d[key](x).tanh()
        return x


def _no_payload():
    assert "aotgrad_trust_payload" not in sys.modules


def test_module_names_with_line_breaks_never_run(tmp_path):
    torch.manual_seed(0)
    model, x = Keyed(), torch.randn(2, 3)
    traced = aotgrad.trace(model, x)
    for gm in (traced.forward, traced.backward):
        code = gm.code
        compile(code, "<check>", "exec")  # one statement a line, as generated
        lines = [line.strip() for line in code.splitlines()]
        assert not any(line.startswith(("import", "pass", "if (1")) for line in lines)
        assert not any(c in code for c in "\r\u2028\x85\x0b\x0c\x1c")
        straight_line_source(gm)
    _no_payload()
    eager = copy.deepcopy(model)
    out = traced(x)
    torch.testing.assert_close(out, eager(x))
    out.sum().backward()
    eager(x).sum().backward()
    path = tmp_path / "k.aotgrad"
    traced.save(path)
    loaded = aotgrad.load(path, module=model)
    torch.testing.assert_close(loaded(x), eager(x))
    assert "param d.a\\n):\\n" in loaded.forward.code
    _no_payload()


def test_a_descriptor_with_line_breaks_in_a_file_never_runs(tmp_path):
    path = _saved(tmp_path)
    marker = tmp_path / "pwned"

    payload = f"x\n):\n    pass\nopen({str(marker)!r}, 'w')\nif (1\r\u2028"

    def visit(data):
        if isinstance(data, dict):
            if data.get("type") == "Input":
                data["fields"]["path"] = payload
            for value in data.values():
                visit(value)
        elif isinstance(data, list):
            for value in data:
                visit(value)

    def edit(h, r, a):
        visit(a["forward"]["descriptors"])
        visit(a["backward"]["descriptors"])

    _rewrite(path, edit)
    loaded = aotgrad.load(path)
    assert "x\\n):\\n" in loaded.forward.code
    assert "x\\n):\\n" in loaded.backward.code
    assert not marker.exists()


def test_show_prints_names_with_line_breaks_as_escapes(tmp_path, capsys):
    source = textwrap.dedent(
        f"""
        import torch

        KEY = {_KEYS[0]!r}
        model = torch.nn.ModuleDict({{KEY: torch.nn.Linear(3, 3)}})

        def fn(x):
            return model[KEY](x)

        def example_inputs():
            return (torch.randn(2, 3),), {{}}
        """
    )
    (tmp_path / "keyed.py").write_text(source)
    assert main(["show", f"{tmp_path / 'keyed.py'}:fn"]) == 0
    out = capsys.readouterr().out
    assert "pass\\nimport aotgrad_trust_payload" in out
    _no_payload()


# -- 4. malformed data is a StoreError --------------------------------------------------------


@pytest.fixture(params=[1000, 20_000], ids=["default-limit", "raised-limit"])
def recursion_limit(request):
    """Python's default recursion limit, and one raised as libraries do (Dynamo: 2000):
    how deep a file may nest must not depend on it (Note [Nesting in a file])."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(request.param)
    yield
    sys.setrecursionlimit(before)


@pytest.mark.parametrize("depth", [900, 5000, 100_000])
def test_deeply_nested_data_is_a_store_error(tmp_path, depth, recursion_limit):
    path = _saved(tmp_path)
    _rewrite(path, lambda h, r, a: r["call"].update(constants="DEEP"))
    head, payload = path.read_bytes().split(b"\n", 1)
    payload = payload.replace(b'"DEEP"', b"[" * depth + b"]" * depth)
    _write(path, json.loads(head), payload)
    with pytest.raises(StoreError):
        aotgrad.load(path)
    path.write_bytes(b"[" * depth + b"]" * depth)
    with pytest.raises(StoreError):
        aotgrad.load(path)


# -- every malformed part of a file is a StoreError at load, not an error at a call ----------


def _first_op(run):
    return next(n for n in run["forward"]["nodes"] if n[1] == "call_function")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r, a: _first_op(r)[3]["tuple"].append("3"), "takes 1 positional"),
        (lambda r, a: _first_op(r).__setitem__(3, {"tuple": ["3"]}), "argument 'self'"),
        (lambda r, a: _first_op(r)[4].update(bogus=1), "no argument 'bogus'"),
        (lambda r, a: _first_op(r).__setitem__(3, {"tuple": []}), "needs its argument 'self'"),
        (lambda r, a: r["plan"]["fields"].update(returned=None), "Plan.returned"),
        (lambda r, a: r["plan"]["fields"].update(mutations={"tuple": [1]}), "Plan.mutations"),
        (lambda r, a: r["call"].update(constants=[]), "structure and its constants"),
        (lambda r, a: r["call"].update(tensor_positions=[5]), "tensor positions"),
        (lambda r, a: r["call"].update(spec=["tuple", None, "x"]), "malformed stored structure"),
        (
            lambda r, a: a["forward"]["values"].__setitem__(0, [[2**70], [1], 0, None, None, 0]),
            "malformed",
        ),
        (lambda r, a: a["signature"]["fields"].update(version="1"), "Signature.version"),
        (lambda r, a: a["forward"]["values"][0].__setitem__(4, {"device": "nowhere"}), "device"),
    ],
)
def test_a_malformed_file_is_a_store_error_at_load(tmp_path, edit, message):
    path = _saved(tmp_path)
    _rewrite(path, lambda h, r, a: edit(r, a))
    with pytest.raises(StoreError, match=message):
        aotgrad.load(path, fw_compiler=lambda gm, example_inputs: gm)


def test_a_cache_entry_of_impossible_sizes_is_a_miss_for_a_users_compiler(cache_dir):
    def f(x):
        return x.exp() * 2

    x = torch.randn(3, requires_grad=True)
    aotgrad.aot_function(f)(x)
    (entry,) = sorted(cache_dir.glob("*/*.aotgrad"))
    huge = [[2**40, 2**40], [0, 0], 0, {"dtype": "float32"}, {"device": "cpu"}, False]
    _rewrite(entry, lambda h, r, a: a["forward"]["values"].__setitem__(1, huge))
    seen = []

    def compiler(gm, example_inputs):
        seen.append(gm)
        return gm

    again = aotgrad.aot_function(f, fw_compiler=compiler, bw_compiler=compiler)
    torch.testing.assert_close(again(x), f(x))
    assert aotgrad.cache_info(again).disk_hits == 0
