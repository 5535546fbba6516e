"""SGLang 0.5.23's memory plan as a pure function (see docs/sglang-memory.md).

``plan(model, gpu, flags)`` answers, without a GPU, what SGLang would allocate for a config and whether it
would start: the simulator runs on it, and the study uses it to skip configs that cannot start.
"""
