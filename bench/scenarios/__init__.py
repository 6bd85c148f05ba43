"""The benchmark's scenarios, one module per part of a run; registry.py lists them in run order."""
