"""Read-only looks at running SGLang servers at one moment: ``autotune inspect`` (``autotune watch``, the same over
time, is the ``autotune.watch`` package above this one)."""
