"""``autotune watch``: a tuned fleet's live traffic against what it was tuned for.

A layer above ``inspect`` (the read-only probe and the planner's advice it reuses) and ``deploy`` (the winner
and fleet file it compares with), below ``cli``. Modules: ``metrics`` (one scrape), ``window`` (the rolling
window and its state file), ``reference`` (what the tuning assumed), ``rules`` (the drift checks), ``suggest``
(the fix and a re-tuning study), ``watcher`` (the cycle loop), ``output`` (lines), ``prometheus`` and ``listen``
(its own series, as a file or over HTTP).
"""
