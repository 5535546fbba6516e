"""The study: the Optuna loop, its starting points, the search space, confirmation, workers and storage."""
