"""Tracing: the joint function run on fake tensors and recorded as one graph.

``joint`` builds the function traced (forward, then backward with cotangents as inputs);
``tracers`` chooses between the direct tracer (``fast/``) and the full, functionalizing
``make_fx`` trace (``full``); ``fake`` holds the fake mode, ``recorder`` and ``session`` what
the process looks like while a trace runs, ``cotangents``, ``decompose`` and ``trace_errors``
what is done to a trace afterwards or when it fails.
"""
