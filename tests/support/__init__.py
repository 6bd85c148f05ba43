"""Helpers shared by the test directories: upstreams, relays, servers, stores and waits.

Fixtures stay in the conftest files, which import what they need from here.
"""
