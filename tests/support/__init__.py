"""What the tests share: real processes to test against (server_process, redis_process,
prometheus_process), in-process worker sockets (worker_sockets), small models (tiny_models,
vision), reference outputs (reference, disagg), /metrics readers (prefix_counters), a load
generator (load), and the one way a test waits for something to happen (wait)."""
