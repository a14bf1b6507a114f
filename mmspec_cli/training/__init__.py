"""Training draft heads for a target (``mmspec train-head``): the target's answers, ViSpec's losses, the loop.

``corpus`` (SOURCE -> conversations), ``answers`` (the target answers them: JSONL, resumable),
``sequences`` (the target's features over each answer), ``losses`` (pure maths), ``passes``
(one step's forward: noise, multi-token passes), ``trainer`` (the loop under ``accelerate``),
``checkpoint``, ``acceptance`` (τ of a head), ``progress``, and ``run`` (all of it in order).
"""
