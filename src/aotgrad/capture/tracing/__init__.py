"""Tracing: the joint function run on fake tensors and recorded as one graph.

``joint`` builds the function traced (forward, then backward with cotangents as inputs), and
``state`` what one trace holds; ``tracers`` chooses between the direct tracer (``fast/``) and
the full, functionalizing ``make_fx`` trace (``full``); ``assemble`` runs that choice and makes
its graph a JointGraph. ``fake`` holds the fake mode, ``recorder``, ``rng`` and ``session``
what the process looks like while a trace runs, ``cotangents``, ``decompose`` and
``trace_errors`` what is done to a trace afterwards or when it fails.
"""
