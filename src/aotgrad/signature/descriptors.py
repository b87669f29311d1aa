"""Descriptors: a typed, printable name for every graph input and output.

A descriptor says what a graph value *is* in the user's terms. It never holds
an index: positions are the calling convention's business (see
``docs/calling-convention.md``), and a descriptor stays valid when the
convention adds or reorders values.

>>> str(Grad(of=Input(path="carry['a']")))
"grad of carry['a']"
>>> str(Cotangent(of=Output(path="[0]")))
'cotangent of output[0]'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def printable(text: str) -> str:
    r"""``text`` with each character that is not printable (a line break of any kind, a
    control character) written as its Python escape, so that a descriptor printed in a
    graph's code, as a comment, can never end that line (Note [User text in code]).

    >>> printable("a\n):\n    pass\nopen('x', 'w')\u2028b")
    "a\\n):\\n    pass\\nopen('x', 'w')\\u2028b"
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# Note [User text in code]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Descriptors hold the user's own names, and a graph file's: a key path, a module's
# qualified name (an ``nn.ModuleDict`` key may be any string), an attribute. They are
# printed in the graphs' generated Python as comments (``x,  # param blocks.a.weight``),
# which Python compiles when ``gm.code`` is read; a key ``"a\n):\n    pass\nopen(...)"``
# once ended the comment and ran as code. Every text field is printed through
# :func:`printable`, which writes ``\n``, ``\r``, ``\x85``, ``\u2028`` and every other
# unprintable character as its escape::
#
#     nn.ModuleDict({"a\nb": lin})   ->   d_a_b_weight,  # param d.a\nb.weight
#
# and ``ExpandedCodeGen`` escapes whatever comment text reaches it again. Node names
# are identifiers (``placeholder_name``, checked ``isidentifier`` in a file); string
# constants in code are ``repr`` s.


@dataclass(frozen=True)
class Descriptor:
    """Base class of all descriptors."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form: ``{"kind": "Input", "path": "x"}``; nested descriptors nest."""
        out: dict[str, Any] = {"kind": type(self).__name__}
        for key, value in vars(self).items():
            if isinstance(value, Descriptor):
                out[key] = value.to_dict()
            elif isinstance(value, tuple):
                out[key] = [v.to_dict() if isinstance(v, Descriptor) else v for v in value]
            else:
                out[key] = value
        return out


@dataclass(frozen=True)
class Input(Descriptor):
    """A tensor leaf of the user's arguments, by its pytree key path: ``carry['a']``."""

    path: str

    def __str__(self) -> str:
        return printable(self.path)


@dataclass(frozen=True)
class Param(Descriptor):
    """A module parameter lifted to a graph input, by qualified name: ``fc1.weight``."""

    name: str

    def __str__(self) -> str:
        return f"param {printable(self.name)}"


@dataclass(frozen=True)
class Buffer(Descriptor):
    """A module buffer lifted to a graph input, by qualified name: ``bn.running_mean``."""

    name: str

    def __str__(self) -> str:
        return f"buffer {printable(self.name)}"


@dataclass(frozen=True)
class Closure(Descriptor):
    """A tensor the function reaches through a closure cell, a default argument or its bound
    ``self``, lifted to a graph input, by the expression that reaches it: ``lin.weight``.

    See Note [Closed-over tensors] in ``signature/closures.py``.
    """

    name: str

    def __str__(self) -> str:
        return f"closure {printable(self.name)}"


@dataclass(frozen=True)
class Global(Descriptor):
    """A tensor the function reaches through a global name, lifted to a graph input: ``W``."""

    name: str

    def __str__(self) -> str:
        return f"global {printable(self.name)}"


@dataclass(frozen=True)
class Inner(Descriptor):
    """A plain tensor inside a tensor subclass input, by the input and its attribute path:
    ``x.a``, ``param fc.weight._local_tensor`` (Note [Tensor subclasses]).

    >>> str(Inner(of=Param(name="fc.weight"), attr="_local_tensor"))
    'param fc.weight._local_tensor'
    """

    of: Input | Param | Buffer | Closure | Global | Inner
    attr: str

    def __str__(self) -> str:
        return f"{self.of}.{printable(self.attr)}"


PrimalDescriptor = Input | Param | Buffer | Closure | Global | Inner


@dataclass(frozen=True)
class InputBase(Descriptor):
    """One graph input standing for several inputs that share memory.

    See Note [Aliased inputs] in ``capture/analyses/input_aliases.py``.
    """

    of: tuple[Input | Param | Buffer | Closure | Global | Inner, ...]

    def __str__(self) -> str:
        return "base of " + ", ".join(str(d) for d in self.of)


GraphInputDescriptor = Input | Param | Buffer | Closure | Global | Inner | InputBase


@dataclass(frozen=True)
class Draw(Descriptor):
    """A random draw of the forward, taken as an input the host draws with torch: the node it
    replaced, its op and its module (Note [Random draws as inputs] in ``partition/draws.py``).

    >>> str(Draw(name="bernoulli", op="aten.bernoulli.p", module="drop"))
    'draw bernoulli: aten.bernoulli.p in drop'
    """

    name: str
    op: str
    module: str = ""

    def __str__(self) -> str:
        where = f" in {printable(self.module)}" if self.module else ""
        return f"draw {printable(self.name)}: {printable(self.op)}{where}"


@dataclass(frozen=True)
class Output(Descriptor):
    """A leaf of the user's result, by key path below ``output``: ``[1]``, ``[0]['a']``."""

    path: str

    def __str__(self) -> str:
        return f"output{printable(self.path)}"


@dataclass(frozen=True)
class SideEffect(Output):
    """A traced value the function stored in the user's state, stored again at every call.

    ``path`` is the place (``self.acts``, ``closure feats``, ``global CACHE``),
    ``how`` is ``"append"`` (to a list) or ``"set"`` (an attribute, a dict key, a
    variable), ``leaf`` the tensor's key path inside the stored value (``[1]`` of
    ``("name", t)``). See Note [Side effects replayed] in ``capture/user_state/side_effects.py``.

    >>> str(SideEffect(path="self.acts", how="append"))
    'side effect self.acts.append(·)'
    >>> str(SideEffect(path="self.stats['k']", how="set", leaf="[0]"))
    "side effect self.stats['k'] = ·[0]"
    """

    how: str = "set"
    leaf: str = ""

    def __post_init__(self) -> None:
        if self.how not in ("append", "set"):
            raise ValueError(f"expected how 'append' or 'set', got {self.how!r}")

    def __str__(self) -> str:
        if self.how == "append":
            return f"side effect {self.path}.append(·{self.leaf})"
        return f"side effect {self.path} = ·{self.leaf}"


@dataclass(frozen=True)
class MultiOutputView(Output):
    """An output that is one of several views an op made at once (``unbind``, ``split``,
    ``chunk``), or a view of one: eager refuses to change it in place with grad mode on, and
    to use it after its base changed in place; so does the compiled function. See Note
    [Multi-output views] in ``capture/analyses/aliasing.py``.

    >>> str(MultiOutputView(path="[0]"))
    'output[0] (multi-output view)'
    """

    def __str__(self) -> str:
        return f"{super().__str__()} (multi-output view)"


@dataclass(frozen=True)
class OutputBase(Descriptor):
    """An intermediate that several outputs are views of; the runtime rebuilds them from it.

    See Note [Aliased outputs] in ``capture/analyses/aliasing.py``.
    """

    of: tuple[Output, ...]

    def __str__(self) -> str:
        return "base of " + ", ".join(str(o) for o in self.of)


@dataclass(frozen=True)
class MutatedInput(Descriptor):
    """The new value of an input the function mutated in place; copied back after the call.

    With ``storage``, the value ``set_()`` put into the input, over a storage the
    function made: the caller's tensor gets a fresh storage holding it (Note [set_()
    on an input] in ``capture/analyses/set_storage.py``).

    >>> str(MutatedInput(of=Input(path="a"), storage=True))
    'value set into a (set_)'
    """

    of: Input | Param | Buffer | Closure | Global | Inner | InputBase
    storage: bool = False

    def __str__(self) -> str:
        return f"value set into {self.of} (set_)" if self.storage else f"new value of {self.of}"


@dataclass(frozen=True)
class StateAtBackward(Descriptor):
    """An input's value when the backward runs: the backward reads it and returns its new
    value (a ``MutatedInput`` among its outputs). A checkpointed BatchNorm's running
    statistics, an input a custom Function's backward changes in place (Note [State updated
    by the backward] in ``capture/analyses/backward_state.py``).

    >>> str(StateAtBackward(of=Buffer(name="bn.running_mean")))
    'buffer bn.running_mean at backward'
    """

    of: Input | Param | Buffer | Closure | Global | Inner | InputBase

    def __str__(self) -> str:
        return f"{self.of} at backward"


@dataclass(frozen=True)
class Saved(Descriptor):
    """A forward value the backward needs, by its node name in the forward graph."""

    name: str

    def __str__(self) -> str:
        return f"saved: {printable(self.name)}"


@dataclass(frozen=True)
class Cotangent(Descriptor):
    """The incoming gradient of a differentiable forward output."""

    of: Output | OutputBase | MutatedInput

    def __str__(self) -> str:
        return f"cotangent of {self.of}"


@dataclass(frozen=True)
class Grad(Descriptor):
    """The gradient of the loss with respect to a forward input."""

    of: Input | Param | Buffer | Closure | Global | Inner | InputBase

    def __str__(self) -> str:
        return f"grad of {self.of}"
