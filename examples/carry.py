"""The seed notebook's scan body: two dict pytrees in, a dict and a tensor out.

    aotgrad show examples/carry.py:fn

The body reads its inputs in the order biases, b, weights, a; the graphs'
inputs still follow the pytree order carry['a'], carry['b'], x['weights'],
x['biases'].
"""

import torch


def fn(carry, x):
    biases = x["biases"]
    carry_b = carry["b"]
    weights = x["weights"]
    carry_a = carry["a"]
    new_carry_a = torch.sin((carry_a @ weights) + biases)
    new_carry_b = torch.cos((carry_b @ weights) + biases)
    y = torch.sigmoid(new_carry_a + new_carry_b)
    return {"a": new_carry_a, "b": new_carry_b}, y


def example_inputs():
    """Arguments for ``fn``: ``(args, kwargs)``."""
    torch.manual_seed(0)
    carry = {
        "a": torch.randn(2, 3, requires_grad=True),
        "b": torch.randn(2, 3, requires_grad=True),
    }
    x = {
        "weights": torch.randn(3, 3, requires_grad=True),
        "biases": torch.randn(2, 3, requires_grad=True),
    }
    return (carry, x), {}
