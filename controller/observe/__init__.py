"""What the controller shows of itself: Prometheus metrics, the scrape-time fleet
collector and the per-executor admin report."""
