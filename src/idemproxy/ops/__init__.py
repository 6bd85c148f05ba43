"""Operator tooling for jobs (SPEC §3.3, §13): one view, one set of operations, two front ends
(the admin HTTP API in `idemproxy.admin.jobs` and the `idemproxy jobs` CLI in `cli/ops.py`)."""
