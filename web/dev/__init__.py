"""Development tools: the devserver behind `make serve` and the private redis-server it (and the
tests) start."""
