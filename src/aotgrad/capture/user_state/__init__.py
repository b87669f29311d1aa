"""The user's state a trace watches: what the function reads or stores outside its arguments.

Tensors it closes over (``closed_over``), values it stores in the user's objects
(``side_effects``), environment variables it reads (``environ``) and host reads of a tensor's
value kept as checks in the graph (``host_checks``).
"""
