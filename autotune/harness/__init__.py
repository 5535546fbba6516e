"""One trial: start a server, replay the workload, watch the GPU, stop the server, return a TrialResult."""
