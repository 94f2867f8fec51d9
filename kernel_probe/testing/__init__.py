"""Simulators of a job: many virtual ranks in one process, for tests, benchmarks and scale.

``sim``: a deterministic network of rank cores with a fake clock (membership and SQL);
``vhost``: virtual ranks each behind its own real ZeroMQ sockets, many per process. The
helpers that drive real jobs in the tests (a launcher, network namespaces, a hostile peer,
generated data) live in the repository's ``tests/support``, not in the package."""
