"""Past one process: KV events for routers (ZeroMQ, vLLM's wire format).

Needs the ``distributed`` extra (``pip install -e ".[distributed]"``).
"""
