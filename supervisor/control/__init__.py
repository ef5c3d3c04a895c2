"""The control socket: protocol, server, client and the `vllm-supervisorctl` CLI."""
