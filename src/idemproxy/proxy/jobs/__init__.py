"""Governed requests: the loop around the core, upstream order and hedging, attempts, leases."""
