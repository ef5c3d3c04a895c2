"""The front door: the proxy on the public port, its routes, routing by model, admission,
continued streams and client latency.
"""
