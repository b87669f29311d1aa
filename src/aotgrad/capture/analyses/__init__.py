"""Analyses of the traced joint graph: what the function did, read off the trace.

What it did to its inputs (``mutation``, ``set_storage``, ``subclass_inputs``,
``requires_grad``, ``backward_state``, ``input_aliases``) and which outputs alias what
(``aliasing``); which gradients are ``None`` (``reachability``); symbolic sizes (``dynamic``),
autocast regions, checkpoint recomputes, random draws and collectives.
"""
