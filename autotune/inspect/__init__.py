"""Read-only looks at running SGLang servers: ``autotune inspect`` (one moment) and ``autotune watch`` (over time)."""
