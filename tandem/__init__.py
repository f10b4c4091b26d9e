"""The `tandem` command: one entry point for the controller, the executors, a local server
(controller plus executors) and the benchmarks of a checkout. See tandem.cli."""
