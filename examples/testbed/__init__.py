"""An emulated multi-host cluster on one machine: network namespaces, veth pairs, a bridge, tbf.

The library and its CLI are `examples/testbed/netns.py` (docs/testbed.md). This file imports
nothing so that `python -m examples.testbed.netns` runs the module exactly once.
"""
