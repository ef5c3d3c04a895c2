"""The front door over several processes (`proxy.workers` > 1): the daemon keeps every
decision, each worker carries the connections it accepted (docs/proxy.md)."""
